"""Server pieces that need no running server: flags, stop-string hold-back, error messages."""

from __future__ import annotations

import asyncio

import pytest
from helpers import tiny_llm

from specserve import SamplingParams
from specserve.engine.async_engine import AsyncLLMEngine, EngineDeadError, ServerOverloadedError
from specserve.entrypoints.cli import build_parser, main
from specserve.entrypoints.openai.api_server import make_parser
from specserve.entrypoints.openai.cli_args import API_KEY_ENV, server_config_from_args
from specserve.entrypoints.openai.errors import validation_message
from specserve.entrypoints.openai.streaming import ChoiceTracker, stop_holdback
from specserve.outputs import CompletionOutput

ISSUE_COMMAND = ["--host", "127.0.0.1", "--port", "8000", "--model", "M", "--seed", "42",
                 "-tp", "1", "--speculative_model", "D", "--use-v2-block-manager",
                 "--num_speculative_tokens", "5", "--gpu_memory_utilization", "0.8"]


def test_issue_command_line_parses():
    args = make_parser().parse_args(ISSUE_COMMAND)
    assert (args.host, args.port, args.model, args.seed) == ("127.0.0.1", 8000, "M", 42)
    assert args.tensor_parallel_size == 1 and args.speculative_model == "D"
    assert args.num_speculative_tokens == 5 and args.gpu_memory_utilization == 0.8
    assert args.use_v2_block_manager is True


def test_serve_subcommand_and_both_spellings(monkeypatch):
    monkeypatch.setenv(API_KEY_ENV, "from-env")
    args = build_parser().parse_args(["serve", "my-model", "--max_waiting_seqs", "7",
                                      "--max-request-body-bytes", "1M", "--served-model-name",
                                      "a", "b", "--speculative-config",
                                      '{"model": "[ngram]", "num_speculative_tokens": 3}'])
    assert args.model_tag == "my-model" and args.speculative_config["model"] == "[ngram]"
    config = server_config_from_args(args)
    assert config.max_waiting_seqs == 7 and config.max_request_body_bytes == 2**20
    assert config.served_model_names == ("a", "b") and config.api_key == "from-env"


def test_chat_template_from_file(tmp_path):
    path = tmp_path / "t.jinja"
    path.write_text("{{ messages[0]['content'] }}")
    args = make_parser().parse_args(["--chat-template", str(path)])
    assert server_config_from_args(args).chat_template == "{{ messages[0]['content'] }}"


@pytest.mark.parametrize("argv, words", [
    (["serve", "a", "--model", "b"], "two models"),
    (["serve", "--model", "/nonexistent", "--max-waiting-seqs", "-1"], "max-waiting-seqs"),
    (["serve", "--model", "/nonexistent", "--chat-template", "no-such-file"], "chat-template"),
    (["serve", "--model", "/nonexistent", "--port", "70000"], "port"),
])
def test_bad_serve_flags_fail_before_loading(argv, words, capsys):
    assert main(argv) == 2
    assert words in capsys.readouterr().err


@pytest.mark.parametrize("text, stops, held", [
    ("hello wor", ["world"], 3),
    ("hello", ["lo!"], 2),
    ("hello", ["xyz"], 0),
    ("abcab", ["abcabd"], 5),
    ("a", ["ab", "b"], 1),
    ("", ["ab"], 0),
])
def test_stop_holdback(text, stops, held):
    assert stop_holdback(text, stops) == held


def test_tracker_deltas_concatenate_to_final_text_across_a_stop():
    tracker = ChoiceTracker(stops=["STOP"])
    steps = [("Hello S", None), ("Hello ST", None), ("Hello STa", None), ("Hello STaSTO", None),
             ("Hello STa", "stop")]  # the engine cut the text where the stop began
    sent = ""
    for i, (text, reason) in enumerate(steps):
        out = CompletionOutput(0, text, list(range(i + 1)), None, None, reason)
        delta = tracker.advance(out)
        if delta is not None:
            sent += delta.text
            assert text.startswith(sent)
    assert sent == "Hello STa"
    assert tracker.advance(CompletionOutput(0, "x", [0], None, None, "stop")) is None


def test_validation_message_names_the_field():
    errors = [{"type": "int_parsing", "loc": ("body", "max_tokens"), "msg": "Input should be a "
               "valid integer", "input": "ten"},
              {"type": "extra_forbidden", "loc": ("body", "foo"), "msg": "Extra", "input": 1},
              {"type": "string_type", "loc": ("body", "", "x"), "msg": "odd", "input": 1}]
    message, param = validation_message(errors)
    assert param in ("max_tokens", "")
    assert "max_tokens" in message and "'ten'" in message and "foo" in message


# ---- the async engine in-process ------------------------------------------------------------
def test_async_engine_capacity_abort_and_failing_step(tiny_llama):
    llm = tiny_llm(tiny_llama, max_model_len=128, num_gpu_blocks_override=64, max_num_seqs=2)
    engine = llm.llm_engine
    ids = llm.get_tokenizer()("The quick brown fox").input_ids
    greedy = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)

    async def main() -> None:
        ae = AsyncLLMEngine(engine, max_waiting_seqs=1)  # capacity 3 sequences
        await ae.start()
        handles = [ae.submit(f"r{i}", ids, SamplingParams(max_tokens=100, ignore_eos=True))
                   for i in range(3)]
        with pytest.raises(ServerOverloadedError, match="capacity"):
            ae.submit("r3", ids, greedy)
        for h in handles:  # a first token each, then the clients go away
            assert len((await anext(h)).outputs[0].token_ids) >= 1
            h.close()
        metrics = await ae.get_metrics()
        assert metrics["kv_cache_usage"] == 0.0 and metrics["num_running"] == 0
        assert ae.num_seqs_in_flight == 0

        real_step, calls = engine.step, []

        def failing_once():
            calls.append(1)
            if len(calls) == 1:
                raise RuntimeError("boom")
            return real_step()

        engine.step = failing_once
        bad = ae.submit("bad", ids, greedy)
        with pytest.raises(EngineDeadError, match="boom"):
            async for _ in bad:
                pass
        bad.close()
        outs = [o async for o in ae.submit("good", ids, greedy)]  # the loop still serves
        assert outs[-1].finished and len(outs[-1].outputs[0].token_ids) == 4
        assert ae.is_running and ae.num_step_failures == 1
        await ae.shutdown()

    asyncio.run(main())
