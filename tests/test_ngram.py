"""Prompt-lookup ("[ngram]") speculation."""

from __future__ import annotations

import numpy as np
import pytest
from helpers import tiny_llm

from specserve import SamplingParams
from specserve.spec_decode.ngram import find_ngram_proposal


@pytest.mark.parametrize("tokens, n_max, n_min, k, expected", [
    ([1, 2, 3, 4, 5, 1, 2, 3, 9, 9, 1, 2, 3], 3, 1, 3, [9, 9, 1]),  # most recent match wins
    ([1, 2, 3, 4, 1, 2, 3], 3, 1, 10, [4, 1, 2, 3]),  # never past the known tokens
    ([5, 6, 7], 3, 1, 3, []),  # no earlier occurrence
    ([7, 1, 2, 8, 2], 2, 1, 2, [8, 2]),  # falls back to a shorter n-gram
    ([7, 1, 2, 8, 2], 2, 2, 2, []),  # ... but not below n_min
])
def test_find_ngram_proposal(tokens, n_max, n_min, k, expected):
    assert find_ngram_proposal(np.array(tokens), n_max, n_min, k) == expected


def test_ngram_greedy_equals_plain_and_accepts_repetition(tiny_llama, test_prompts):
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    repetitive = [" ".join([p] * 3) for p in test_prompts[:6]]
    plain = tiny_llm(tiny_llama).generate(repetitive, params, use_tqdm=False)
    llm = tiny_llm(tiny_llama, speculative_model="[ngram]", num_speculative_tokens=5,
                   ngram_prompt_lookup_max=4)
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
