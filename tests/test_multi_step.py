"""Multi-step greedy decoding (``num_scheduler_steps``): several decode forwards per scheduling
round, each token fed back without a host round trip, must give exactly the one-step output.

The device-side feedback through the CUDA-graph buffers is tested in test_cuda_graphs.py (the
padded path, run eagerly under the Triton interpreter); here the engine's window logic runs
on the CPU path: stops inside a window, max_tokens shorter than a window, sampled and logprobs
requests (no window), preemption, and the argument checks.
"""

from __future__ import annotations

import pytest
from helpers import tiny_llm

from specserve import SamplingParams
from specserve.worker.model_runner import ModelRunner

GREEDY = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)


def _windows(monkeypatch) -> list[int]:
    """Spy on the runner: the length of every multi-step window run."""
    sizes: list[int] = []
    original = ModelRunner.execute_argmax_steps_device

    def spy(self, runs, num_steps, first=None):
        sizes.append(num_steps)
        return original(self, runs, num_steps, first)

    monkeypatch.setattr(ModelRunner, "execute_argmax_steps_device", spy)
    return sizes


def _summary(outputs) -> list[tuple]:
    return [(o.outputs[0].token_ids, o.outputs[0].text, o.outputs[0].finish_reason,
             o.outputs[0].stop_reason) for o in outputs]


def test_windows_give_the_one_step_output(tiny_llama, test_prompts, monkeypatch):
    prompts = test_prompts[:6]
    single = tiny_llm(tiny_llama)
    reference = single.generate(prompts, GREEDY, use_tqdm=False)
    tokens = [o.outputs[0].token_ids for o in reference]
    # stops that fire inside a window: a token id and a text stop taken from the reference
    # output, a max_tokens that is not a multiple of the window, EOS respected
    params = [
        GREEDY,
        SamplingParams(temperature=0.0, max_tokens=11, ignore_eos=True),
        SamplingParams(temperature=0.0, max_tokens=24, stop_token_ids=[tokens[2][9]],
                       ignore_eos=True),
        SamplingParams(temperature=0.0, max_tokens=24, stop=[reference[3].outputs[0].text[20:26]],
                       ignore_eos=True),
        SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True),
        SamplingParams(temperature=0.0, max_tokens=24),
    ]
    want = _summary(single.generate(prompts, params, use_tqdm=False))
    assert want[2][2] == "stop" and want[3][2] == "stop"  # the stops do fire
    sizes = _windows(monkeypatch)
    for steps in (4, 8):
        multi = tiny_llm(tiny_llama, num_scheduler_steps=steps)
        assert _summary(multi.generate(prompts, params, use_tqdm=False)) == want
        assert multi.llm_engine.block_manager.num_free_blocks == \
            single.llm_engine.block_manager.num_free_blocks  # lookahead slots all returned
    assert sizes and max(sizes) == 8 and all(1 < n <= 8 for n in sizes)


def test_no_window_for_sampled_or_logprobs_requests(tiny_llama, test_prompts, monkeypatch):
    prompts = test_prompts[:3]
    sampled = SamplingParams(temperature=0.8, seed=7, max_tokens=12)
    logprobs = SamplingParams(temperature=0.0, max_tokens=12, logprobs=2, ignore_eos=True)
    params = [GREEDY, sampled, logprobs]
    want = _summary(tiny_llm(tiny_llama).generate(prompts, params, use_tqdm=False))
    sizes = _windows(monkeypatch)
    got = tiny_llm(tiny_llama, num_scheduler_steps=4).generate(prompts, params, use_tqdm=False)
    assert _summary(got) == want
    # windows only once the sampled and logprobs requests are done (greedy runs to 24 tokens)
    assert sizes and sum(sizes) <= GREEDY.max_tokens - 12


def test_windows_under_preemption(tiny_llama, test_prompts):
    reference = tiny_llm(tiny_llama).generate(test_prompts, GREEDY, use_tqdm=False)
    small = tiny_llm(tiny_llama, num_gpu_blocks_override=24, max_model_len=256,
                     num_scheduler_steps=6)
    outs = small.generate(test_prompts, GREEDY, use_tqdm=False)
    assert small.llm_engine.scheduler.num_preemptions > 0
    assert _summary(outs) == _summary(reference)
    assert small.llm_engine.block_manager.num_free_blocks == 24


def test_window_stops_at_the_context_limit(tiny_llama):
    prompt = list(range(5, 45))  # 40 tokens, context 48: 8 can be generated
    params = SamplingParams(temperature=0.0, max_tokens=100, ignore_eos=True)
    want = tiny_llm(tiny_llama, max_model_len=48).generate(
        [{"prompt_token_ids": prompt}], params, use_tqdm=False)
    got = tiny_llm(tiny_llama, max_model_len=48, num_scheduler_steps=16).generate(
        [{"prompt_token_ids": prompt}], params, use_tqdm=False)
    assert _summary(got) == _summary(want)
    assert len(got[0].outputs[0].token_ids) == 8 and got[0].outputs[0].finish_reason == "length"


def test_argument_checks(tiny_llama):
    for bad in (0, -2, 1.5, True):
        with pytest.raises(ValueError, match="num_scheduler_steps"):
            tiny_llm(tiny_llama, num_scheduler_steps=bad)
    with pytest.raises(ValueError, match="num_scheduler_steps=4 cannot be combined"):
        tiny_llm(tiny_llama, num_scheduler_steps=4, speculative_model="[ngram]",
                 num_speculative_tokens=3, ngram_prompt_lookup_max=3)


def test_window_slots_take_no_token_budget(tiny_llama, test_prompts, monkeypatch):
    """A window's later forwards are one token per sequence each: its reserved slots must not
    eat the step's token budget (else a large batch is split into several windows)."""
    prompts = test_prompts[:12]
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    want = _summary(tiny_llm(tiny_llama, max_num_batched_tokens=64).generate(
        prompts, params, use_tqdm=False))
    batches: list[int] = []
    original = ModelRunner.execute_argmax_steps

    def spy(self, runs, num_steps):
        batches.append(len(runs))
        return original(self, runs, num_steps)

    monkeypatch.setattr(ModelRunner, "execute_argmax_steps", spy)
    llm = tiny_llm(tiny_llama, max_num_batched_tokens=64, num_scheduler_steps=8)
    assert _summary(llm.generate(prompts, params, use_tqdm=False)) == want
    assert batches and batches[0] == len(prompts)  # 12 x 8 slots > 64 tokens of budget


DRAFT_MODES = {  # how a greedy batch drafts: (multi_step window, proposals left on device)
    "stepwise": (False, False), "window": (True, False), "device": (True, True)}


def _draft_llm(tiny_llama, tiny_llama_draft, mode: str, monkeypatch, log: list):
    """A greedy draft-model LLM in one drafting mode; every verified step's proposals (as the
    verifier saw them, values read back) are appended to log."""
    from specserve.spec_decode.verifier import Verifier

    llm = tiny_llm(tiny_llama, speculative_model=str(tiny_llama_draft),
                   num_speculative_tokens=4, speculative_adaptive=False)
    proposer = llm.llm_engine.speculation.proposer
    proposer.multi_step, proposer.device_proposals = DRAFT_MODES[mode]
    verifier = llm.llm_engine.verifier
    accept = Verifier.accept_greedy
    monkeypatch.setattr(verifier, "accept_greedy", lambda proposals, rows: (
        log.append([list(p) for p in proposals]), accept(proposals, rows))[1])
    on_device = proposer._propose_on_device
    llm.device_steps = []  # steps whose proposals were verified straight from the device
    monkeypatch.setattr(proposer, "_propose_on_device", lambda *a: (
        llm.device_steps.append(1), on_device(*a))[1])
    return llm


def _draft_every_mode(tiny_llama, tiny_llama_draft, prompts, monkeypatch):
    """Generate greedily in every drafting mode; each must give plain greedy's output and
    use device proposals exactly in "device" mode. Returns, per mode, (the proposals of every
    verified step, the window lengths run)."""
    want = _summary(tiny_llm(tiny_llama).generate(prompts, GREEDY, use_tqdm=False))
    results = {}
    for mode in DRAFT_MODES:
        log: list = []
        llm = _draft_llm(tiny_llama, tiny_llama_draft, mode, monkeypatch, log)
        sizes = _windows(monkeypatch)
        assert _summary(llm.generate(prompts, GREEDY, use_tqdm=False)) == want
        assert bool(llm.device_steps) == (mode == "device")
        results[mode] = (log, list(sizes))  # later modes wrap this spy again
    return results


def test_greedy_draft_proposes_in_one_window(tiny_llama, tiny_llama_draft, test_prompts,
                                             monkeypatch):
    """A plain greedy batch with a fixed k drafts proposals 2..k in one multi-step window,
    with or without reading them back before verification: the proposals (and so the
    output) are those of k single draft steps."""
    results = _draft_every_mode(tiny_llama, tiny_llama_draft, test_prompts[:4], monkeypatch)
    assert not results["stepwise"][1]
    for mode in ("window", "device"):  # proposals 2..4 per drafting step (max_tokens caps k)
        sizes = results[mode][1]
        assert sizes and max(sizes) == 3 and min(sizes) >= 1
    assert results["stepwise"][0] == results["window"][0] == results["device"][0]
    assert sum(map(len, results["device"][0][1])) > 0


def test_greedy_draft_window_with_mixed_k(tiny_llama, tiny_llama_draft, test_prompts,
                                          monkeypatch):
    """Sequences wanting different k (1..4) share one window of the longest k: the shorter
    ones ride along and are cut, so every sequence proposes exactly what k single draft steps
    would have, and the output stays plain greedy."""
    from specserve.spec_decode.driver import SpeculationDriver

    limit = SpeculationDriver._limit
    monkeypatch.setattr(SpeculationDriver, "_limit", lambda self, s, b, extra=0: min(
        limit(self, s, b, extra), 1 + s.seq.seq_id % 4))
    results = _draft_every_mode(tiny_llama, tiny_llama_draft, test_prompts[:4], monkeypatch)
    for mode in ("window", "device"):
        sizes = results[mode][1]
        assert sizes and max(sizes) == 3  # one window per drafting step, the longest k
    device = results["device"][0]
    assert results["stepwise"][0] == results["window"][0] == device
    assert any(len({len(p) for p in step} - {0}) > 1 for step in device)  # mixed k ran
