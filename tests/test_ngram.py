"""Prompt-lookup ("[ngram]") speculation."""

from __future__ import annotations

import numpy as np
import pytest
from helpers import tiny_llm

from specserve import SamplingParams
from specserve.spec_decode.evidence import aligned_evidence
from specserve.spec_decode.ngram import (
    ALIGN_WINDOW,
    AlignedNgramIndex,
    NgramIndex,
    NgramProposer,
    find_ngram_proposal,
)
from specserve.spec_decode.spec_config import SpeculativeConfig


@pytest.mark.parametrize("tokens, n_max, n_min, k, expected", [
    ([1, 2, 3, 4, 5, 1, 2, 3, 9, 9, 1, 2, 3], 3, 1, 3, [9, 9, 1]),  # most recent match wins
    ([1, 2, 3, 4, 1, 2, 3], 3, 1, 10, [4, 1, 2, 3]),  # never past the known tokens
    ([5, 6, 7], 3, 1, 3, []),  # no earlier occurrence
    ([7, 1, 2, 8, 2], 2, 1, 2, [8, 2]),  # falls back to a shorter n-gram
    ([7, 1, 2, 8, 2], 2, 2, 2, []),  # ... but not below n_min
])
def test_find_ngram_proposal(tokens, n_max, n_min, k, expected):
    assert find_ngram_proposal(tokens, n_max, n_min, k) == expected
    assert _search(np.array(tokens), n_max, n_min, k) == expected


def _search(tokens: np.ndarray, n_max: int, n_min: int, k: int) -> list[int]:
    """The definition, by brute force: compare the tail with every earlier window."""
    length = tokens.shape[0]
    for n in range(min(n_max, length - 1), n_min - 1, -1):
        windows = np.lib.stride_tricks.sliding_window_view(tokens[: length - 1], n)
        hits = np.flatnonzero((windows == tokens[length - n :]).all(axis=1))
        if hits.size:
            start = int(hits[-1]) + n
            return tokens[start : start + k].tolist()
    return []


@pytest.mark.parametrize("n_max, n_min", [(4, 1), (3, 2), (1, 1)])
def test_incremental_index_equals_a_full_search_at_every_step(n_max, n_min):
    """A sequence's index, grown by 1..6 committed tokens per step (as speculation commits
    them), proposes exactly what searching the whole sequence would, every step."""
    rng = np.random.default_rng(n_max * 10 + n_min)
    tokens = rng.integers(0, 6, 30).tolist()  # a small vocabulary: many repeats
    index = NgramIndex(n_max, n_min)
    matched = 0
    while len(tokens) < 400:
        expected = _search(np.array(tokens), n_max, n_min, 5)
        assert index.propose(tokens, 5) == expected
        matched += bool(expected)
        tokens += rng.integers(0, 6, int(rng.integers(1, 7))).tolist()
    assert matched > 50


# ---- aligned lookup (ngram_prompt_lookup_aligned) --------------------------------------------
def _aligned_search(tokens: list[int], start: int, n_max: int, n_min: int, k: int,
                    window: int = ALIGN_WINDOW) -> tuple[list[int], int]:
    """The definition, by brute force: at every position p from start on, the lookup after
    tokens[:p] (the first occurrence of the longest tail that has one at most `window` past
    the anchor, else the most recent occurrence of the longest tail); the anchor moves right
    after the occurrence's follower when that follower equals tokens[p]."""
    def lookup(p: int, anchor: int | None) -> tuple[int, int] | None:
        ends = {n: [e for e in range(n, p) if tokens[e - n : e] == tokens[p - n : p]]
                for n in range(min(n_max, p - 1), n_min - 1, -1)}
        if anchor is not None:
            for n, found in ends.items():
                near = [e for e in found if anchor <= e <= anchor + window]
                if near:
                    return near[0], aligned_evidence(n)
        for n, found in ends.items():
            if found:
                return found[-1], n
        return None

    anchor = None
    for p in range(start, len(tokens)):
        hit = lookup(p, anchor)
        if hit is not None and tokens[hit[0]] == tokens[p]:
            anchor = hit[0] + 1
    hit = lookup(len(tokens), anchor)
    return ([], 0) if hit is None else (tokens[hit[0] : hit[0] + k], hit[1])


def test_aligned_lookup_follows_the_occurrence_being_copied():
    """A rename: the answer copies "\\n def f ( a , b ) :" as "def g (". Its tail "(" occurs
    twice in the prompt; vLLM's rule proposes what followed the most recent one (a later call),
    the aligned lookup what followed the one right after the copied "def" (which the lookup
    after the prompt's closing newline pointed at, so it anchored the copy)."""
    prompt = [11, 1, 2, 3, 4, 5, 6, 7, 8, 30, 9, 3, 10, 7, 12, 11]  # \n def f ( a , b ) : ..
    tokens = prompt + [1, 20, 3]  # def g (
    assert NgramIndex(3, 1).match(tokens, 5) == ([10, 7, 12, 11, 1], 1)
    aligned = AlignedNgramIndex(3, 1, start=len(prompt))
    assert aligned.match(tokens, 5) == ([4, 5, 6, 7, 8], aligned_evidence(1))
    assert _aligned_search(tokens, len(prompt), 3, 1, 5) == ([4, 5, 6, 7, 8],
                                                            aligned_evidence(1))
    # the anchor is right after "def" (index 2); the "(" it finds is followed at index 4: within
    # a window of 2, past one of 1 (then the most recent occurrence, as vLLM's rule)
    assert AlignedNgramIndex(3, 1, len(prompt), window=2).match(tokens, 2) == (
        [4, 5], aligned_evidence(1))
    assert AlignedNgramIndex(3, 1, len(prompt), window=1).match(tokens, 2) == ([10, 7], 1)
    # before anything was copied there is no anchor: the aligned lookup is vLLM's rule
    fresh = prompt + [20, 3]
    assert AlignedNgramIndex(3, 1, start=len(prompt)).match(fresh, 5) == (
        NgramIndex(3, 1).match(fresh, 5))


@pytest.mark.parametrize("n_max, n_min, window", [(4, 1, ALIGN_WINDOW), (3, 2, 8), (2, 1, 4)])
def test_aligned_index_equals_its_definition_however_tokens_arrive(n_max, n_min, window):
    """The anchor is a function of the text: an index fed 1..6 tokens per step (as
    speculation commits them) proposes, at every step, what the brute-force definition
    computes from the whole sequence, and what an index fed one token at a time does."""
    rng = np.random.default_rng(n_max * 100 + n_min * 10 + window)
    source = rng.integers(0, 8, 60).tolist()
    prompt = source + rng.integers(0, 8, 20).tolist()
    # the "answer": the source copied with edits (substitutions, insertions, deletions)
    answer = []
    for token in source * 3:
        r = rng.random()
        if r < 0.1:
            answer.append(int(rng.integers(0, 8)))
        elif r < 0.15:
            answer += [token, int(rng.integers(0, 8))]
        elif r > 0.95:
            continue
        else:
            answer.append(token)
    chunked = AlignedNgramIndex(n_max, n_min, len(prompt), window)
    stepwise = AlignedNgramIndex(n_max, n_min, len(prompt), window)
    length, aligned_hits = len(prompt), 0
    while length < len(prompt) + len(answer):
        tokens = (prompt + answer)[:length]
        for extra in range(max(len(prompt), stepwise.aligned_upto), length):
            stepwise.match(tokens[:extra], 5)
        expected = _aligned_search(tokens, len(prompt), n_max, n_min, 5, window)
        assert chunked.match(tokens, 5) == expected
        assert stepwise.match(tokens, 5) == expected
        aligned_hits += expected[1] != (expected[1] & 0xFFFF)
        length += int(rng.integers(1, 7))
    assert aligned_hits > 10


def test_aligned_option_is_validated_and_reaches_the_proposer():
    spec = SpeculativeConfig.from_args(speculative_config={
        "method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3,
        "prompt_lookup_aligned": True})
    assert spec.ngram_prompt_lookup_aligned
    assert not SpeculativeConfig.from_args(speculative_model="[ngram]", num_speculative_tokens=3,
                                           ngram_prompt_lookup_max=3).ngram_prompt_lookup_aligned
    with pytest.raises(ValueError, match="ngram_prompt_lookup_aligned applies to"):
        SpeculativeConfig.from_args(speculative_model="/some/draft", num_speculative_tokens=3,
                                    ngram_prompt_lookup_aligned=True)
    with pytest.raises(ValueError, match="must be True or False"):
        SpeculativeConfig.from_args(speculative_model="[ngram]", num_speculative_tokens=3,
                                    ngram_prompt_lookup_max=3, ngram_prompt_lookup_aligned=1)
    from specserve.engine.sequence import Sequence

    prompt = [11, 1, 2, 3, 4, 5, 6, 7, 8, 30, 9, 3, 10, 7, 12, 11]
    seq = Sequence(0, "r", 0, prompt, SamplingParams(max_tokens=8), 0.0)
    seq.token_ids += [1, 20, 3]
    out = NgramProposer(3, 1, aligned=True).propose([seq], [5])
    assert out.token_ids == [[4, 5, 6, 7, 8]] and out.match_lengths == [aligned_evidence(1)]
    assert NgramProposer(3, 1).propose([seq], [5]).token_ids == [[10, 7, 12, 11, 1]]


def test_ngram_greedy_equals_plain_and_accepts_repetition(tiny_llama, test_prompts):
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    repetitive = [" ".join([p] * 3) for p in test_prompts[:6]]
    plain = tiny_llm(tiny_llama).generate(repetitive, params, use_tqdm=False)
    llm = tiny_llm(tiny_llama, speculative_model="[ngram]", num_speculative_tokens=5,
                   ngram_prompt_lookup_max=4, speculative_adaptive=False)  # always verify
    spec = llm.generate(repetitive, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in spec] == [o.outputs[0].token_ids for o in plain]
    assert llm.get_metrics()["spec_decode"]["num_draft_tokens"] > 0
    aligned = tiny_llm(tiny_llama, speculative_model="[ngram]", num_speculative_tokens=5,
                       ngram_prompt_lookup_max=4, ngram_prompt_lookup_aligned=True,
                       speculative_adaptive=False)
    out = aligned.generate(repetitive, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in out] == [o.outputs[0].token_ids for o in plain]
    assert aligned.get_metrics()["spec_decode"]["num_accepted_tokens"] > 0


def test_aligned_evidence_reaches_the_policy_classes(tiny_llama, test_prompts):
    """End to end with the adaptive policy on: the aligned proposals' evidence travels through
    the driver into classes of their own (evidence.ALIGNED), and the output stays plain
    decoding's."""
    from specserve.spec_decode.evidence import LENGTH_CLASSES

    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    repetitive = [" ".join([p] * 3) for p in test_prompts[:4]]
    plain = tiny_llm(tiny_llama).generate(repetitive, params, use_tqdm=False)
    llm = tiny_llm(tiny_llama, speculative_model="[ngram]", num_speculative_tokens=4,
                   ngram_prompt_lookup_max=3, ngram_prompt_lookup_aligned=True)
    out = llm.generate(repetitive, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in out] == [o.outputs[0].token_ids for o in plain]
    reached = llm.llm_engine.speculation.adaptive.evidence.reached  # [class, depth]
    assert reached[LENGTH_CLASSES:, 0].sum() > 0  # aligned classes learned something


def test_ngram_sampled_requests_work(tiny_llama, test_prompts):
    llm = tiny_llm(tiny_llama, speculative_config={
        "method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3,
        "prompt_lookup_min": 2})
    params = SamplingParams(temperature=0.8, seed=5, max_tokens=24, ignore_eos=True)
    a = llm.generate(test_prompts[9], params, use_tqdm=False)[0].outputs[0].token_ids
    b = llm.generate(test_prompts[9], params, use_tqdm=False)[0].outputs[0].token_ids
    assert a == b and len(a) == 24


@pytest.mark.slow
@pytest.mark.parametrize("method, aligned", [("[ngram]", False), ("[ngram]", True),
                                             ("[suffix]", False), ("[suffix]", True)])
def test_smollm2_repeat_prompt_greedy_equal_and_high_acceptance(smollm2_gguf, method, aligned):
    """SmolLM2 asked to repeat its input: output equals plain decoding, and the draft-free
    proposals are accepted in long runs (fixed k, so that the proposer is measured, not the
    adaptive policy)."""
    from specserve import LLM

    text = ("The quick brown fox jumps over the lazy dog. Pack my box with five dozen liquor "
            "jugs. How vexingly quick daft zebras jump!")
    plain = LLM(model=str(smollm2_gguf), device="cpu", max_model_len=1024)
    prompt = plain.apply_chat_template([{"role": "user", "content":
                                         f"Repeat this text exactly, nothing else:\n\n{text}"}])
    params = SamplingParams(temperature=0.0, max_tokens=40)
    expected = plain.generate(prompt, params, use_tqdm=False)[0].outputs[0].token_ids
    del plain
    extra = ({"ngram_prompt_lookup_max": 4, "ngram_prompt_lookup_aligned": aligned}
             if method == "[ngram]" else {"ngram_prompt_lookup_aligned": aligned})
    llm = LLM(model=str(smollm2_gguf), device="cpu", max_model_len=1024,
              speculative_model=method, num_speculative_tokens=5, speculative_adaptive=False,
              **extra)
    out = llm.generate(prompt, params, use_tqdm=False)[0].outputs[0]
    assert out.token_ids == expected
    spec = llm.get_metrics()["spec_decode"]
    assert spec["mean_acceptance_length"] > 2.5, spec
