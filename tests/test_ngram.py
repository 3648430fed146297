"""Prompt-lookup ("[ngram]") speculation."""

from __future__ import annotations

import numpy as np
import pytest
from helpers import tiny_llm

from specserve import SamplingParams
from specserve.spec_decode.ngram import NgramIndex, find_ngram_proposal


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


def test_ngram_greedy_equals_plain_and_accepts_repetition(tiny_llama, test_prompts):
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    repetitive = [" ".join([p] * 3) for p in test_prompts[:6]]
    plain = tiny_llm(tiny_llama).generate(repetitive, params, use_tqdm=False)
    llm = tiny_llm(tiny_llama, speculative_model="[ngram]", num_speculative_tokens=5,
                   ngram_prompt_lookup_max=4, speculative_adaptive=False)  # always verify
    spec = llm.generate(repetitive, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in spec] == [o.outputs[0].token_ids for o in plain]
    assert llm.get_metrics()["spec_decode"]["num_draft_tokens"] > 0


def test_ngram_sampled_requests_work(tiny_llama, test_prompts):
    llm = tiny_llm(tiny_llama, speculative_config={
        "method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3,
        "prompt_lookup_min": 2})
    params = SamplingParams(temperature=0.8, seed=5, max_tokens=24, ignore_eos=True)
    a = llm.generate(test_prompts[9], params, use_tqdm=False)[0].outputs[0].token_ids
    b = llm.generate(test_prompts[9], params, use_tqdm=False)[0].outputs[0].token_ids
    assert a == b and len(a) == 24


@pytest.mark.slow
@pytest.mark.parametrize("method", ["[ngram]", "[suffix]"])
def test_smollm2_repeat_prompt_greedy_equal_and_high_acceptance(smollm2_gguf, method):
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
    extra = {"ngram_prompt_lookup_max": 4} if method == "[ngram]" else {}
    llm = LLM(model=str(smollm2_gguf), device="cpu", max_model_len=1024,
              speculative_model=method, num_speculative_tokens=5, speculative_adaptive=False,
              **extra)
    out = llm.generate(prompt, params, use_tqdm=False)[0].outputs[0]
    assert out.token_ids == expected
    spec = llm.get_metrics()["spec_decode"]
    assert spec["mean_acceptance_length"] > 2.5, spec
