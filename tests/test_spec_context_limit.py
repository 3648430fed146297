"""Speculation near the context length: proposals are truncated so that no position at or past
max_model_len (or, for the draft, speculative_max_model_len) is ever scheduled or computed,
and the output still equals plain decoding up to the limit (finish_reason "length").

Every method is checked with full-length proposals wherever they fit: the repetitive prompts
make "[ngram]" and "[suffix]" propose k tokens almost every step, and the draft is the target
itself (everything is accepted), so each sequence walks into the limit with maximal runs.
"""

from __future__ import annotations

import pytest
from helpers import tiny_llm

from specserve import SamplingParams

MAX_MODEL_LEN = 64
K = 5
BLOCK_SIZE = 16


class Spy:
    """Records what every target/draft forward computes and what the scheduler reserves."""

    def __init__(self, engine) -> None:
        self.target_positions: list[int] = []
        self.draft_positions: list[int] = []
        self.reserved: list[tuple[int, int]] = []  # (slots the table must cover, its capacity)
        self.proposals: list[tuple[int, int]] = []  # (tokens before the step, proposals)
        self._wrap_runner(engine.runner, self.target_positions)
        draft_runner = getattr(engine.speculation.proposer, "runner", None)
        if draft_runner is not None:
            self._wrap_runner(draft_runner, self.draft_positions)
        schedule = engine.scheduler.schedule

        def spy_schedule():
            out = schedule()
            for s in out.scheduled:
                need = s.seq.num_computed_tokens + s.num_new_tokens + s.num_lookahead
                self.reserved.append((need, len(s.seq.block_table) * BLOCK_SIZE))
            return out

        engine.scheduler.schedule = spy_schedule
        propose = engine.speculation.propose

        def spy_propose(scheduled, sampled, *args, **kwargs):
            proposals, probs, pending = propose(scheduled, sampled, *args, **kwargs)
            for s, p in zip(sampled, proposals, strict=True):
                self.proposals.append((s.seq.num_tokens, len(p)))
            return proposals, probs, pending

        engine.speculation.propose = spy_propose

    @staticmethod
    def _wrap_runner(runner, positions: list[int]) -> None:
        def spy(execute):
            def run(runs):
                for r in runs:
                    positions.extend(range(r.start, r.start + len(r.token_ids)))
                return execute(runs)
            return run

        # logits, or argmax ids (the greedy fast path)
        runner.execute = spy(runner.execute)
        execute_argmax_device = runner.execute_argmax_device

        def argmax_device(runs, fed=None):  # every argmax pass, device proposals or not
            for r in runs:
                positions.extend(range(r.start, r.start + len(r.token_ids)))
            return execute_argmax_device(runs, fed)

        runner.execute_argmax_device = argmax_device
        steps = runner.execute_argmax_steps_device

        def window(runs, num_steps, first=None):  # one token per run, num_steps forwards
            for r in runs:
                positions.extend(range(r.start, r.start + num_steps))
            return steps(runs, num_steps, first)

        runner.execute_argmax_steps_device = window


def _prompts(tokenizer_llm, lengths: list[int]) -> list[list[int]]:
    """Repetitive prompts of the given token lengths (a repeated 7-token phrase)."""
    base = tokenizer_llm.get_tokenizer().encode("the cat sat on the mat and")[:7]
    return [(base * (n // len(base) + 1))[:n] for n in lengths]


METHODS = {
    "ngram": lambda tiny: dict(speculative_model="[ngram]", ngram_prompt_lookup_max=3),
    "suffix": lambda tiny: dict(speculative_model="[suffix]"),
    # ... with the aligned prompt lookup beside the suffix trees (spec_decode/hybrid.py)
    "suffix-lookup": lambda tiny: dict(speculative_model="[suffix]",
                                       ngram_prompt_lookup_aligned=True),
    "draft": lambda tiny: dict(speculative_model=str(tiny)),
    # the draft's proposals and the next verification launched ahead (the CUDA default)
    "draft-ahead": lambda tiny: dict(speculative_model=str(tiny)),
}


def _launch_ahead(llm, method: str) -> None:
    """"draft-ahead": what CUDA does by default (off on the CPU)."""
    if method == "draft-ahead":
        llm.llm_engine.speculation.proposer.launch_ahead_enabled = True
        llm.llm_engine.verify_ahead_enabled = True


@pytest.mark.parametrize("adaptive", [False, True])
@pytest.mark.parametrize("method", list(METHODS))
def test_proposals_stop_at_max_model_len(tiny_llama, method, adaptive, single_thread):
    # Room left for 1 .. K + 3 new tokens: every truncation of a K-token run happens.
    lengths = [MAX_MODEL_LEN - room for room in range(1, K + 4)] + [MAX_MODEL_LEN - 20]
    plain = tiny_llm(tiny_llama, max_model_len=MAX_MODEL_LEN)
    prompts = _prompts(plain, lengths)
    params = SamplingParams(temperature=0.0, max_tokens=None, ignore_eos=True)
    expected = [o.outputs[0].token_ids
                for o in plain.generate(prompt_token_ids=prompts, sampling_params=params,
                                        use_tqdm=False)]
    llm = tiny_llm(tiny_llama, max_model_len=MAX_MODEL_LEN, num_speculative_tokens=K,
                   speculative_adaptive=adaptive, **METHODS[method](tiny_llama))
    _launch_ahead(llm, method)
    spy = Spy(llm.llm_engine)
    outs = llm.generate(prompt_token_ids=prompts, sampling_params=params, use_tqdm=False)
    for prompt, out, ref in zip(prompts, outs, expected, strict=True):
        assert out.outputs[0].token_ids == ref
        assert len(prompt) + len(ref) == MAX_MODEL_LEN
        assert out.outputs[0].finish_reason == "length"
    assert max(spy.target_positions) < MAX_MODEL_LEN - 1  # the last token is never fed back
    assert all(need <= MAX_MODEL_LEN for need, _ in spy.reserved)
    assert all(before + k < MAX_MODEL_LEN for before, k in spy.proposals)
    if spy.draft_positions:
        assert max(spy.draft_positions) < MAX_MODEL_LEN - 1
    spec = llm.get_metrics()["spec_decode"]
    assert spec["num_draft_tokens"] > 0
    if not adaptive and method != "ngram":  # ngram's proposals depend on the random model's
        # Proposals were truncated, not dropped: a run right below the limit still speculated.
        assert any(0 < k < K and before + k == MAX_MODEL_LEN - 1 for before, k in spy.proposals)


@pytest.mark.parametrize("method", list(METHODS))
def test_limit_with_a_kv_cache_of_exactly_max_model_len(tiny_llama, method, single_thread):
    """Lookahead slots past the limit would need a block the cache does not have: the sequence
    would preempt itself forever. The reservation stops at max_model_len instead."""
    plain = tiny_llm(tiny_llama, max_model_len=MAX_MODEL_LEN)
    prompts = _prompts(plain, [MAX_MODEL_LEN - 20])
    params = SamplingParams(temperature=0.0, max_tokens=None, ignore_eos=True)
    expected = plain.generate(prompt_token_ids=prompts, sampling_params=params,
                              use_tqdm=False)[0].outputs[0].token_ids
    llm = tiny_llm(tiny_llama, max_model_len=MAX_MODEL_LEN, num_speculative_tokens=K,
                   num_gpu_blocks_override=MAX_MODEL_LEN // BLOCK_SIZE,
                   speculative_adaptive=False, **METHODS[method](tiny_llama))
    _launch_ahead(llm, method)
    out = llm.generate(prompt_token_ids=prompts, sampling_params=params, use_tqdm=False)[0]
    assert out.outputs[0].token_ids == expected
    assert out.outputs[0].finish_reason == "length"
    assert llm.llm_engine.scheduler.num_preemptions == 0


@pytest.mark.parametrize("method", list(METHODS))
def test_sampled_requests_stop_at_max_model_len(tiny_llama, method, single_thread):
    llm = tiny_llm(tiny_llama, max_model_len=MAX_MODEL_LEN, num_speculative_tokens=K,
                   **METHODS[method](tiny_llama))
    _launch_ahead(llm, method)
    spy = Spy(llm.llm_engine)
    prompts = _prompts(llm, [MAX_MODEL_LEN - room for room in (1, 2, 4, 6, 9)])
    params = SamplingParams(temperature=0.8, seed=3, max_tokens=None, ignore_eos=True)
    outs = llm.generate(prompt_token_ids=prompts, sampling_params=params, use_tqdm=False)
    for prompt, out in zip(prompts, outs, strict=True):
        assert len(prompt) + len(out.outputs[0].token_ids) == MAX_MODEL_LEN
        assert out.outputs[0].finish_reason == "length"
    assert max(spy.target_positions) < MAX_MODEL_LEN - 1
    assert all(need <= MAX_MODEL_LEN for need, _ in spy.reserved)


def test_draft_stops_at_speculative_max_model_len(tiny_llama, single_thread):
    """Past speculative_max_model_len the draft never runs; the target still reaches its own
    limit, with output equal to plain decoding."""
    spec_len = 48
    plain = tiny_llm(tiny_llama, max_model_len=MAX_MODEL_LEN)
    prompts = _prompts(plain, [spec_len - room for room in (1, 3, 6)] + [spec_len + 4])
    params = SamplingParams(temperature=0.0, max_tokens=None, ignore_eos=True)
    expected = [o.outputs[0].token_ids
                for o in plain.generate(prompt_token_ids=prompts, sampling_params=params,
                                        use_tqdm=False)]
    for method in METHODS:
        llm = tiny_llm(tiny_llama, max_model_len=MAX_MODEL_LEN, num_speculative_tokens=K,
                       speculative_max_model_len=spec_len, speculative_adaptive=False,
                       **METHODS[method](tiny_llama))
        _launch_ahead(llm, method)
        spy = Spy(llm.llm_engine)
        outs = llm.generate(prompt_token_ids=prompts, sampling_params=params, use_tqdm=False)
        assert [o.outputs[0].token_ids for o in outs] == expected
        assert all(o.outputs[0].finish_reason == "length" for o in outs)
        assert max(spy.target_positions) < MAX_MODEL_LEN - 1
        assert all(before + k <= spec_len for before, k in spy.proposals if k)
        if method.startswith("draft"):
            assert max(spy.draft_positions) < spec_len - 1
            # truncated, not skipped: a sequence 3 tokens below the limit still speculated
            assert any(0 < k < K and before + k == spec_len for before, k in spy.proposals)
        spec = llm.get_metrics()["spec_decode"]
        assert spec["num_past_spec_max_len"] > 0
