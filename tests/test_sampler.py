"""Logits processing and sampling: references (Python, transformers), seeds, distribution.

Intentional differences from transformers, all confined to float-rounding at exact boundaries
(random continuous logits never hit them):
- min-p compares in log space (logit < max_logit + log(min_p)) instead of comparing softmax
  probabilities; mathematically identical, and it skips a softmax.
- top-p's threshold 1 - p is computed in float32 from a float32 p (transformers computes it in
  float64 from a Python float).
"""

from __future__ import annotations

import pytest
import torch
from scipy.stats import chisquare
from transformers import (
    MinPLogitsWarper,
    RepetitionPenaltyLogitsProcessor,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from specserve.sample.logits_processing import (
    SamplingTensors,
    apply_penalties,
    process_logits,
)
from specserve.sample.sampler import (
    compute_logprobs,
    gather_logprobs,
    probs_from_final_logits,
    sample,
)
from specserve.sampling_params import SamplingParams

CPU = torch.device("cpu")


def _tensors(
    params: list[SamplingParams],
    vocab: int,
    outputs: list[list[int]] | None = None,
    prompts: list[list[int]] | None = None,
    blocked: list[list[int]] | None = None,
) -> SamplingTensors:
    rows = len(params)
    return SamplingTensors.from_rows(
        params,
        outputs if outputs is not None else [[] for _ in range(rows)],
        prompts if prompts is not None else [[] for _ in range(rows)],
        vocab,
        CPU,
        blocked_token_ids=blocked,
    )


def _random_logits(rows: int, vocab: int, seed: int, scale: float = 3.0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(rows, vocab, generator=gen) * scale  # [R, V]


def _assert_same_final(ours: torch.Tensor, ref: torch.Tensor) -> None:
    assert torch.equal(torch.isneginf(ours), torch.isneginf(ref))
    finite = torch.isfinite(ref)
    torch.testing.assert_close(ours[finite], ref[finite], rtol=1e-5, atol=1e-5)


# --------------------------------------------------------------------------- building tensors


def test_from_rows_neutral_values_and_flags() -> None:
    params = [SamplingParams(temperature=0.0), SamplingParams(top_k=500, top_p=0.8),
              SamplingParams(top_k=-1, min_p=0.1)]
    t = _tensors(params, vocab=100)
    assert t.temperature.tolist() == pytest.approx([0.0, 1.0, 1.0])
    assert t.top_k.tolist() == [100, 100, 100]  # disabled or >= vocab -> vocab
    assert t.greedy.tolist() == [True, False, False]
    assert not t.all_greedy and not t.all_random
    assert t.no_penalties and t.no_top_k and not t.no_top_p and not t.no_min_p
    assert t.output_token_counts is None and t.prompt_token_mask is None and t.logit_bias is None
    assert t.top_k.dtype == torch.int64 and t.temperature.dtype == torch.float32
    low = SamplingTensors.from_rows(params, [[]] * 3, [[]] * 3, 100, CPU, torch.bfloat16)
    assert low.top_p.dtype == torch.float32  # bf16 would turn top_p=0.8 into 0.80078


def test_output_counts_and_prompt_mask() -> None:
    params = [SamplingParams(repetition_penalty=1.2), SamplingParams()]
    # id 10 is outside the vocab (e.g. an added token) and must be ignored, not crash.
    t = _tensors(params, vocab=8, outputs=[[1, 1, 3, 10], [2]], prompts=[[4, 10], [5]])
    assert t.output_token_counts is not None and t.prompt_token_mask is not None
    assert t.output_token_counts[0].tolist() == [0, 2, 0, 1, 0, 0, 0, 0]
    assert t.output_token_counts[1].tolist() == [0] * 8  # row without penalties stays neutral
    assert t.prompt_token_mask[0].nonzero().flatten().tolist() == [4]


# --------------------------------------------------------------------------- penalties


def _reference_penalties(
    logits: torch.Tensor, p: SamplingParams, out: list[int], prompt: list[int]
) -> torch.Tensor:
    row = logits.tolist()
    seen = set(out) | set(prompt)
    for tok in range(len(row)):
        x = row[tok]
        if tok in seen:
            x = x / p.repetition_penalty if x > 0 else x * p.repetition_penalty
        x -= p.frequency_penalty * out.count(tok)
        x -= p.presence_penalty * (tok in out)
        row[tok] = x
    return torch.tensor(row)


def test_penalties_match_python_reference() -> None:
    vocab = 40
    params = [
        SamplingParams(presence_penalty=0.7),
        SamplingParams(frequency_penalty=-1.3),
        SamplingParams(repetition_penalty=1.8),
        SamplingParams(repetition_penalty=0.6, presence_penalty=-0.4, frequency_penalty=0.9),
        SamplingParams(),  # batch mate without penalties
    ]
    gen = torch.Generator().manual_seed(0)
    outputs = [torch.randint(0, vocab, (n,), generator=gen).tolist() for n in (9, 12, 5, 20, 7)]
    prompts = [torch.randint(0, vocab, (n,), generator=gen).tolist() for n in (6, 3, 11, 4, 8)]
    logits = _random_logits(len(params), vocab, seed=1)
    t = _tensors(params, vocab, outputs, prompts)
    ours = apply_penalties(logits, t)
    for r, p in enumerate(params):
        ref = _reference_penalties(logits[r], p, outputs[r], prompts[r])
        torch.testing.assert_close(ours[r], ref, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("penalty", [0.5, 1.3, 2.0])
def test_repetition_penalty_matches_transformers(penalty: float) -> None:
    vocab = 64
    gen = torch.Generator().manual_seed(2)
    outputs = [torch.randint(0, vocab, (n,), generator=gen).tolist() for n in (3, 10, 0)]
    prompts = [torch.randint(0, vocab, (n,), generator=gen).tolist() for n in (8, 2, 5)]
    logits = _random_logits(3, vocab, seed=3)
    params = [SamplingParams(repetition_penalty=penalty)] * 3
    ours = apply_penalties(logits, _tensors(params, vocab, outputs, prompts))
    hf = RepetitionPenaltyLogitsProcessor(penalty)
    for r in range(3):
        ids = torch.tensor([prompts[r] + outputs[r]])
        ref = hf(ids, logits[r : r + 1].clone())[0]
        torch.testing.assert_close(ours[r], ref)


# --------------------------------------------------------------------------- filtering


def _hf_final(logits: torch.Tensor, p: SamplingParams) -> torch.Tensor:
    """Transformers' warper chain in its generate() order: temperature, top-k, top-p, min-p."""
    scores = logits.unsqueeze(0).clone()
    ids = torch.zeros(1, 1, dtype=torch.long)
    if p.temperature != 1.0:
        scores = TemperatureLogitsWarper(p.temperature)(ids, scores)
    if p.top_k > 0:
        scores = TopKLogitsWarper(p.top_k)(ids, scores)
    if p.top_p < 1.0:
        scores = TopPLogitsWarper(p.top_p)(ids, scores)
    if p.min_p > 0.0:
        scores = MinPLogitsWarper(p.min_p)(ids, scores)
    return scores[0]


FILTER_ROWS = [
    SamplingParams(top_k=1),
    SamplingParams(top_k=7),
    SamplingParams(top_k=300),
    SamplingParams(top_p=0.05),
    SamplingParams(top_p=0.5),
    SamplingParams(top_p=0.95),
    SamplingParams(min_p=0.02),
    SamplingParams(min_p=0.3),
    SamplingParams(min_p=1.0),
    SamplingParams(temperature=0.7, top_k=50, top_p=0.9),
    SamplingParams(temperature=1.5, top_p=0.8, min_p=0.05),
    SamplingParams(temperature=0.3, top_k=20, top_p=0.7, min_p=0.1),
    SamplingParams(temperature=1.2),
    SamplingParams(),
]


def test_filters_match_transformers_batched() -> None:
    """One batched call, each row with its own filters, against transformers row by row."""
    vocab = 500
    logits = _random_logits(len(FILTER_ROWS), vocab, seed=4)
    ours = process_logits(logits, _tensors(FILTER_ROWS, vocab))
    for r, p in enumerate(FILTER_ROWS):
        _assert_same_final(ours[r], _hf_final(logits[r], p))
    # Not vacuous: every filtered row masked something.
    for r, p in enumerate(FILTER_ROWS):
        filtered = p.top_k > 0 or p.top_p < 1 or p.min_p > 0
        assert bool(torch.isneginf(ours[r]).any()) == filtered


@pytest.mark.parametrize("seed", range(5))
@pytest.mark.parametrize("which", ["top_k", "top_p", "min_p"])
def test_single_filter_matches_transformers(which: str, seed: int) -> None:
    vocab = 257
    gen = torch.Generator().manual_seed(100 + seed)
    values = {
        "top_k": [int(k) for k in torch.randint(1, vocab, (6,), generator=gen)],
        "top_p": [float(x) for x in torch.rand(6, generator=gen).clamp(min=0.01)],
        "min_p": [float(x) for x in torch.rand(6, generator=gen) * 0.5],
    }[which]
    params = [SamplingParams(**{which: v}) for v in values]
    logits = _random_logits(len(params), vocab, seed=200 + seed, scale=2.0)
    ours = process_logits(logits, _tensors(params, vocab))
    for r, p in enumerate(params):
        _assert_same_final(ours[r], _hf_final(logits[r], p))


def test_top_k_keeps_ties_at_boundary_like_transformers() -> None:
    logits = torch.tensor([[5.0, 3.0, 3.0, 3.0, 1.0, 0.0]])
    p = SamplingParams(top_k=2)
    ours = process_logits(logits, _tensors([p], 6))[0]
    assert torch.isneginf(ours).tolist() == [False, False, False, False, True, True]
    _assert_same_final(ours, _hf_final(logits[0], p))


def test_top_p_keeps_at_least_the_top_token() -> None:
    logits = torch.tensor([[10.0, 0.0, -1.0, -2.0]])
    ours = process_logits(logits, _tensors([SamplingParams(top_p=0.01)], 4))[0]
    assert torch.isfinite(ours).tolist() == [True, False, False, False]


def test_greedy_rows_untouched_and_input_not_mutated() -> None:
    vocab = 30
    logits = _random_logits(3, vocab, seed=5)
    before = logits.clone()
    params = [SamplingParams(temperature=0.0), SamplingParams(temperature=0.5, top_k=3),
              SamplingParams(temperature=0.0)]
    final = process_logits(logits, _tensors(params, vocab))
    assert torch.equal(logits, before)
    assert torch.equal(final[0], logits[0]) and torch.equal(final[2], logits[2])
    assert torch.isneginf(final[1]).sum() == vocab - 3
    greedy_only = _tensors([params[0], params[2]], vocab)
    assert greedy_only.all_greedy
    assert torch.equal(process_logits(logits[[0, 2]], greedy_only), logits[[0, 2]])


def test_logit_bias_allowed_and_blocked_ids() -> None:
    vocab = 10
    logits = torch.zeros(3, vocab)
    params = [
        SamplingParams(logit_bias={2: 1.5, 7: -3.0}),
        SamplingParams(allowed_token_ids=[1, 4, 5], logit_bias={4: 2.0, 8: 9.0}),
        SamplingParams(temperature=0.0),
    ]
    t = _tensors(params, vocab, blocked=[[], [5], [0, 3, 99]])
    final = process_logits(logits, t)
    assert final[0, 2] == 1.5 and final[0, 7] == -3.0 and final[0, 0] == 0.0
    assert torch.isfinite(final[1]).nonzero().flatten().tolist() == [1, 4]
    assert final[1, 4] == 2.0
    assert torch.isneginf(final[2]).nonzero().flatten().tolist() == [0, 3]
    # Greedy respects blocking (min_tokens): the best raw token 0 is forbidden.
    raw = torch.tensor([[9.0, 1.0, 2.0, 0.0] + [0.0] * 6])
    tokens = sample(process_logits(raw, _tensors([params[2]], vocab, blocked=[[0]])),
                    _tensors([params[2]], vocab, blocked=[[0]]), [None])
    assert tokens.tolist() == [2]


# --------------------------------------------------------------------------- sampling


def test_greedy_ties_pick_lowest_index() -> None:
    logits = torch.tensor([[1.0, 3.0, 3.0, 0.0], [2.0, 2.0, 2.0, 2.0]])
    t = _tensors([SamplingParams(temperature=0.0)] * 2, 4)
    assert sample(process_logits(logits, t), t, [None, None]).tolist() == [1, 0]


def test_mixed_batch_greedy_rows_are_argmax() -> None:
    vocab = 50
    logits = _random_logits(4, vocab, seed=6)
    params = [SamplingParams(temperature=0.0), SamplingParams(temperature=1.0),
              SamplingParams(temperature=0.0, repetition_penalty=1.5), SamplingParams(seed=3)]
    t = _tensors(params, vocab, outputs=[[], [], [int(logits[2].argmax())], []])
    final = process_logits(logits, t)
    gens = [None, None, None, torch.Generator().manual_seed(3)]
    tokens = sample(final, t, gens, torch.Generator().manual_seed(0))
    assert tokens.dtype == torch.int64 and tokens.shape == (4,)
    assert tokens[0] == logits[0].argmax() and tokens[2] == final[2].argmax()


def _run_seeded(row: int, batch: int, steps: int, vocab: int) -> list[int]:
    """Decode `steps` tokens for a seeded request placed at `row` among random batch mates."""
    target = SamplingParams(temperature=0.9, top_k=20, presence_penalty=0.5, seed=1234)
    mates = [SamplingParams(temperature=1.1), SamplingParams(temperature=0.0),
             SamplingParams(seed=99, top_p=0.8), SamplingParams(frequency_penalty=1.0)]
    params = [mates[i % len(mates)] for i in range(batch)]
    params[row] = target
    gens = [torch.Generator().manual_seed(p.seed) if p.seed is not None else None for p in params]
    default = torch.Generator().manual_seed(1000 + batch)  # differs between the two runs
    logit_gen = torch.Generator().manual_seed(7)
    mate_gen = torch.Generator().manual_seed(8 + batch)
    outputs: list[list[int]] = [[] for _ in params]
    for _ in range(steps):
        logits = torch.randn(batch, vocab, generator=mate_gen) * 2  # [R, V]
        logits[row] = torch.randn(vocab, generator=logit_gen) * 2  # same for the target
        t = _tensors(params, vocab, outputs, [[0, 1, 2]] * batch)
        tokens = sample(process_logits(logits, t), t, gens, default).tolist()
        for r, tok in enumerate(tokens):
            outputs[r].append(tok)
    return outputs[row]


def test_seeded_row_is_reproducible_and_independent_of_batch_mates() -> None:
    alone = _run_seeded(row=0, batch=1, steps=60, vocab=64)
    in_batch = _run_seeded(row=3, batch=6, steps=60, vocab=64)
    assert alone == in_batch
    assert alone == _run_seeded(row=0, batch=1, steps=60, vocab=64)
    assert len(set(alone)) > 10  # genuinely random, not a degenerate constant


def test_unseeded_rows_follow_default_generator() -> None:
    logits = _random_logits(64, 100, seed=9, scale=0.5)
    t = _tensors([SamplingParams()] * 64, 100)
    a = sample(logits, t, [None] * 64, torch.Generator().manual_seed(5))
    b = sample(logits, t, [None] * 64, torch.Generator().manual_seed(5))
    c = sample(logits, t, [None] * 64, torch.Generator().manual_seed(6))
    assert torch.equal(a, b) and not torch.equal(a, c)


# --------------------------------------------------------------------------- distribution

CHI_LOGITS = torch.tensor([2.0, 1.6, 1.3, 1.0, 0.8, 0.5, 0.2, 0.0, -0.3, -0.8, -1.5, -2.5])
CHI_PARAMS = SamplingParams(temperature=0.7, top_p=0.9)
NUM_DRAWS = 60_000


def _final_row(params: SamplingParams) -> torch.Tensor:
    return process_logits(CHI_LOGITS.unsqueeze(0), _tensors([params], 12))[0]  # [V]


def _draw(final_row: torch.Tensor, params: SamplingParams, seeded_rows: bool) -> torch.Tensor:
    """Sample many tokens from one row of final logits, as one batch of identical rows."""
    rows = NUM_DRAWS if not seeded_rows else NUM_DRAWS // 3
    t = _tensors([params] * rows, 12)
    final = final_row.expand(rows, -1)  # [rows, V]
    if seeded_rows:
        gens = [torch.Generator().manual_seed(10_000 + r) for r in range(rows)]
        return sample(final, t, gens)
    return sample(final, t, [None] * rows, torch.Generator().manual_seed(42))


def _chisquare_pvalue(tokens: torch.Tensor, probs: torch.Tensor) -> float:
    counts = torch.bincount(tokens, minlength=probs.numel()).double()
    support = probs > 0
    if counts[~support].sum() > 0:
        return 0.0  # drew a token the distribution forbids
    expected = probs[support].double()
    expected = expected / expected.sum() * counts.sum()
    return float(chisquare(counts[support].numpy(), expected.numpy()).pvalue)


def test_chi_square_sample_reproduces_final_distribution() -> None:
    final = _final_row(CHI_PARAMS)
    probs = probs_from_final_logits(final)
    assert 0 < int((probs == 0).sum()) < 12  # top_p really cut the tail
    assert _chisquare_pvalue(_draw(final, CHI_PARAMS, seeded_rows=False), probs) > 1e-3
    assert _chisquare_pvalue(_draw(final, CHI_PARAMS, seeded_rows=True), probs) > 1e-3


def test_chi_square_has_power_against_wrong_sampler() -> None:
    final = _final_row(CHI_PARAMS)
    probs = probs_from_final_logits(final)
    # Bug 1: temperature ignored when sampling (same top-p support, so only the shape of the
    # distribution can give it away).
    no_temperature = torch.where(torch.isfinite(final), CHI_LOGITS, float("-inf"))
    assert _chisquare_pvalue(_draw(no_temperature, CHI_PARAMS, False), probs) < 1e-6
    # Bug 2: top-p ignored (draws land outside the nucleus).
    no_top_p = _final_row(SamplingParams(temperature=0.7))
    assert _chisquare_pvalue(_draw(no_top_p, CHI_PARAMS, False), probs) < 1e-6


# --------------------------------------------------------------------------- logprobs


def test_logprobs_are_of_raw_model_distribution() -> None:
    raw = _random_logits(3, 20, seed=11)
    lp = compute_logprobs(raw)
    assert lp.dtype == torch.float32
    torch.testing.assert_close(lp, torch.log_softmax(raw, dim=-1))
    torch.testing.assert_close(lp.exp().sum(-1), torch.ones(3))
    half = compute_logprobs(raw.to(torch.bfloat16))
    assert half.dtype == torch.float32


def test_gather_logprobs_rank_and_top() -> None:
    lp = torch.log_softmax(torch.tensor([[0.0, 3.0, 1.0, 2.0], [1.0, 1.0, 0.0, 5.0]]), dim=-1)
    token_lp, rank, top_ids, top_lp = gather_logprobs(lp, torch.tensor([2, 1]), num_top=2)
    torch.testing.assert_close(token_lp, lp[[0, 1], [2, 1]])
    # Row 0: token 2 is third best. Row 1: tokens 0 and 1 tie for second -> rank 3 (vLLM's >=).
    assert rank.tolist() == [3, 3]
    assert top_ids[0].tolist() == [1, 3] and top_ids[1, 0] == 3
    torch.testing.assert_close(top_lp, lp.gather(1, top_ids))
    _, _, none_ids, none_lp = gather_logprobs(lp, torch.tensor([0, 0]), num_top=0)
    assert none_ids.shape == (2, 0) and none_lp.shape == (2, 0)


def test_top1_rank_is_one() -> None:
    lp = compute_logprobs(_random_logits(5, 50, seed=12))
    _, rank, _, _ = gather_logprobs(lp, lp.argmax(-1), num_top=1)
    assert rank.tolist() == [1] * 5
