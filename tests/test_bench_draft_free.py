"""benchmarks/bench_draft_free_cpu.py's repeats: a repeat of a prompt must start from what the
engine's speculation knew before the prompt's first run. Were the state not put back, "[suffix]"
would find the prompt's own answer in its cache of earlier outputs on the second run and propose
it whole, and the fastest of the repeats would measure memorisation, not speculation."""

from __future__ import annotations

import sys

import pytest

from specserve.entrypoints.cli import BENCHMARKS_DIR

sys.path.insert(0, str(BENCHMARKS_DIR))
import bench_draft_free_cpu as bench  # noqa: E402  (a script beside the package, not inside it)

PROMPT = "Repeat this function exactly:\ndef add(a, b):\n    return a + b\n"


@pytest.fixture(scope="module")
def engines(smollm2_gguf):
    return {"specserve": bench.Ours(), "suffix": bench.Ours(speculative_model="[suffix]")}


def cached_requests(engine: bench.Ours) -> int:
    return len(engine.llm.llm_engine.speculation.proposer.cache.entries)


def test_restore_forgets_what_a_run_taught(engines):
    suffix = engines["suffix"]
    prompt = suffix.chat_ids(PROMPT)
    before = suffix.speculation_state()
    cached = cached_requests(suffix)
    suffix.generate([prompt], 8)
    assert cached_requests(suffix) == cached + 1
    suffix.restore_speculation(before)
    assert cached_requests(suffix) == cached
    suffix.restore_speculation(before)  # restorable again: the copy was not handed out
    assert cached_requests(suffix) == cached
    assert engines["specserve"].speculation_state() is None  # a plain engine has none


def test_batch1_repeats_run_each_prompt_from_the_same_state(engines):
    suffix = engines["suffix"]
    prompt = suffix.chat_ids(PROMPT)
    cached = cached_requests(suffix)
    rates, outputs, _ = bench.batch1(engines, [prompt], 24, 0.0, repeats=3)
    assert outputs["suffix"] == outputs["specserve"]  # and every repeat gave the same tokens
    assert set(rates) == set(engines) and all(r > 0 for r in rates.values())
    # each repeat runs three requests (untimed 1 token, timed, 1 token): only the last
    # repeat's stay cached, not all nine
    assert cached_requests(suffix) == cached + 3


def test_batched_takes_turns_one_engine_step_at_a_time(engines, monkeypatch):
    """Batch 32's lockstep (bench.batched): while both engines have requests left they take
    turns step by step, so a slow stretch of the machine hits both; the order rotates from
    round to round, every round counts, and the tokens are plain decoding's."""
    events: list[tuple[str, str]] = []
    for name, engine in engines.items():
        step, submit = engine.step, engine.submit
        monkeypatch.setattr(engine, "step",
                            lambda n=name, f=step: events.append(("step", n)) or f())
        monkeypatch.setattr(engine, "submit",
                            lambda *a, n=name, f=submit: events.append(("submit", n)) or f(*a))
    prompt = engines["suffix"].chat_ids(PROMPT)
    prompts = [prompt, prompt[:-3], prompt]
    rates, outputs, per_round = bench.batched(engines, prompts, 12, 0.0, rounds=2)
    assert outputs["suffix"] == outputs["specserve"] == engines["specserve"].generate(prompts, 12)
    assert len(per_round) == 2 and all(set(r) == set(engines) for r in per_round)
    assert all(r > 0 for r in rates.values())
    starts = [i for i, (kind, _) in enumerate(events) if kind == "submit"][::2]
    assert len(starts) == 2
    for r, start in enumerate(starts):
        order = [events[start][1], events[start + 1][1]]
        assert order == (["specserve", "suffix"] if r == 0 else ["suffix", "specserve"])
        steps = [n for _, n in events[start + 2 : start + 6]]
        assert steps == order * 2, events  # one step each, in turn
