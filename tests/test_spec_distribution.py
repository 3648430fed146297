"""Whole-engine losslessness: sampled output with a draft model has the target's exact law.

The target and draft are the session's tiny llama checkpoints cut down to an 8-token vocabulary
(the first rows of the embedding and lm_head; the tokenizer still decodes them), with the final
norm's gain divided by 3 so the distributions are spread out rather than nearly one-hot. Then
the exact law of 5 generated tokens (8^5 sequences) comes from transformers (float32 model,
float64 softmax) run on every prefix, and thousands of engine samples of the same prompt are
compared with it by chi-square on each pair of consecutive tokens (x1,x2), (x2,x3), (x3,x4),
(x4,x5): the first speculative step proposes 3 tokens after x1, so these pairs cover the
recovered tokens, the accepted runs and the bonus token.

Power: the same test on an engine whose rejection sampler draws the recovered token from p
instead of norm(max(p - q, 0)), or draws the bonus token from the last proposal's position
instead of the next one, must fail with p < 1e-6.
"""

from __future__ import annotations

import itertools
import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from helpers import hf_model
from safetensors.torch import load_file, save_file
from scipy.stats import chisquare

from specserve import LLM, SamplingParams
from specserve.spec_decode import verifier
from specserve.spec_decode.rejection_sampler import rejection_sample

VOCAB = 8
LOGIT_SHRINK = 1.0 / 3.0  # final-norm gain factor: spreads each distribution over the 8 tokens
PROMPT = [3, 3, 7, 5, 6]
MAX_TOKENS = 5
NUM_SPECULATIVE_TOKENS = 3
NUM_SAMPLES = 4000  # per sampling setting
TOP_P = 0.8
PASS_P = 1e-3
FAIL_P = 1e-6
MIN_EXPECTED = 5.0  # chi-square cells with a smaller expected count are pooled
TOP_P_MARGIN = 1e-6  # kept/removed decisions must clear the boundary by more than fp32 error


pytestmark = pytest.mark.usefixtures("single_thread")


def _small_vocab_copy(src: Path, dst: Path) -> Path:
    """Copy a tiny llama checkpoint keeping the first VOCAB tokens and a flatter head."""
    shutil.copytree(src, dst)
    weights = load_file(str(dst / "model.safetensors"))
    for name in ("model.embed_tokens.weight", "lm_head.weight"):
        weights[name] = weights[name][:VOCAB].contiguous()
    weights["model.norm.weight"] = weights["model.norm.weight"] * LOGIT_SHRINK
    save_file(weights, str(dst / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((dst / "config.json").read_text())
    config["vocab_size"] = VOCAB
    (dst / "config.json").write_text(json.dumps(config, indent=2))
    return dst


@pytest.fixture(scope="module")
def models(tiny_llama, tiny_llama_draft, tmp_path_factory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("spec_distribution")
    return (_small_vocab_copy(tiny_llama, root / "target"),
            _small_vocab_copy(tiny_llama_draft, root / "draft"))


# ---- the exact law -------------------------------------------------------------------------
@torch.no_grad()
def _conditionals(path: Path) -> list[torch.Tensor]:
    """cond[d]: [VOCAB] * (d + 1) float64, P(x_{d+1} | prompt, x_1..x_d) for every prefix."""
    model = hf_model(path)
    out = []
    for depth in range(MAX_TOKENS):
        prefixes = list(itertools.product(range(VOCAB), repeat=depth))
        ids = torch.tensor([PROMPT + list(p) for p in prefixes])  # [V^d, len]
        logits = model(ids).logits[:, -1].double()  # [V^d, V]
        out.append(torch.softmax(logits, dim=-1).reshape([VOCAB] * (depth + 1)))
    return out


def _top_p(probs: torch.Tensor, top_p: float) -> tuple[torch.Tensor, float]:
    """Nucleus filter with vLLM / HF semantics, written independently of the engine.

    A token is kept iff the mass of the tokens sorted above it (descending) is < top_p, i.e.
    the engine's "ascending cumulative mass <= 1 - top_p is removed", largest always kept.
    Returns the renormalised distribution and the closest any token comes to the boundary.
    """
    sorted_probs, order = probs.sort(dim=-1, descending=True)
    mass_above = sorted_probs.cumsum(dim=-1) - sorted_probs  # [..., V]
    keep_sorted = mass_above < top_p
    keep = torch.zeros_like(keep_sorted).scatter(-1, order, keep_sorted)
    kept = torch.where(keep, probs, torch.zeros_like(probs))
    margin = float((mass_above - top_p).abs().min())
    return kept / kept.sum(dim=-1, keepdim=True), margin


def _exact_joint(conds: list[torch.Tensor], top_p: float) -> torch.Tensor:
    """[VOCAB] * MAX_TOKENS float64 law of the generated tokens."""
    joint = torch.ones(())
    for depth, cond in enumerate(conds):
        if top_p < 1.0:
            cond = _top_p(cond, top_p)[0]
            # Only prefixes the sampler can reach matter for the boundary check.
            reachable = joint > 0
            if bool(reachable.any()):
                _, reach_margin = _top_p(conds[depth][reachable], top_p)
                assert reach_margin > TOP_P_MARGIN, (depth, reach_margin)
        joint = joint.unsqueeze(-1) * cond.double() if depth else cond.double()
    return joint


# ---- statistics ----------------------------------------------------------------------------
def _chi2_pvalue(observed: np.ndarray, probs: np.ndarray) -> float:
    """Goodness of fit of cell counts to probabilities; impossible observations give 0."""
    observed, probs = observed.ravel().astype(np.float64), probs.ravel() / probs.sum()
    if observed[probs == 0].sum() > 0:
        return 0.0
    expected = probs * observed.sum()
    big, small = expected >= MIN_EXPECTED, (expected < MIN_EXPECTED) & (probs > 0)
    obs, exp = list(observed[big]), list(expected[big])
    if small.any():
        obs.append(observed[small].sum())
        exp.append(expected[small].sum())
    return float(chisquare(obs, exp).pvalue)


def _pair_pvalues(samples: np.ndarray, joint: torch.Tensor) -> list[float]:
    """p-values of (x_t, x_{t+1}) for t = 1..MAX_TOKENS-1 against the exact joint law."""
    pvalues = []
    for t in range(MAX_TOKENS - 1):
        others = tuple(d for d in range(MAX_TOKENS) if d not in (t, t + 1))
        pair = joint.sum(dim=others).numpy() if others else joint.numpy()  # [V, V]
        cells = samples[:, t] * VOCAB + samples[:, t + 1]
        pvalues.append(_chi2_pvalue(np.bincount(cells, minlength=VOCAB * VOCAB), pair))
    return pvalues


# ---- the engine ----------------------------------------------------------------------------
def _generate(models: tuple[Path, Path], top_ps: tuple[float, ...], seed: int, *,
              fixed_k: bool, request_seeds: bool = False):
    """NUM_SAMPLES samples per top_p value, all in one generate() call (mixed batches).

    fixed_k: switch the engine's adaptive speculation off (speculative_adaptive=False), so every
    decoding sequence proposes min(k, tokens left - 1) tokens every step. request_seeds: give
    every request its own seed.
    """
    target, draft = models
    llm = LLM(model=str(target), device="cpu", speculative_model=str(draft),
              num_speculative_tokens=NUM_SPECULATIVE_TOKENS, seed=seed, max_num_seqs=512,
              speculative_adaptive=not fixed_k)
    params = [SamplingParams(temperature=1.0, top_p=top_p, max_tokens=MAX_TOKENS,
                             ignore_eos=True, detokenize=False,
                             seed=seed * 100_000 + i if request_seeds else None)
              for top_p in top_ps for i in range(NUM_SAMPLES)]
    outputs = llm.generate([{"prompt_token_ids": PROMPT}] * len(params), params,
                           use_tqdm=False)
    tokens = np.array([o.outputs[0].token_ids for o in outputs])  # [N, MAX_TOKENS]
    assert tokens.shape == (len(params), MAX_TOKENS)
    per_setting = {top_p: tokens[i * NUM_SAMPLES:(i + 1) * NUM_SAMPLES]
                   for i, top_p in enumerate(top_ps)}
    return per_setting, llm.get_metrics()["spec_decode"]


def _check_speculation_ran(metrics: dict, min_draft_tokens: int) -> None:
    """Proposals were verified, with acceptances and rejections (recovered tokens) and some
    multi-token steps, so the test exercised every branch of the sampler."""
    assert metrics["num_draft_tokens"] >= min_draft_tokens, metrics
    assert metrics["num_accepted_tokens"] > 0, metrics
    assert 0.0 < metrics["draft_acceptance_rate"] < 1.0, metrics
    assert metrics["mean_acceptance_length"] > 1.0, metrics


def _recover_from_p(target_probs, target_argmax, draft_token_ids, draft_probs, num_draft_host,
                    greedy, generators, default_generator, **kwargs):
    """The real sampler, except that a rejected position's token is redrawn from p."""
    res = rejection_sample(target_probs, target_argmax, draft_token_ids, draft_probs,
                           num_draft_host, greedy, generators, default_generator, **kwargs)
    if target_probs is None:
        return res
    num_draft = torch.tensor(num_draft_host, device=res.num_accepted.device)
    rows = ((res.num_accepted < num_draft) & ~greedy).nonzero().squeeze(1)
    if rows.numel():
        pos = res.num_accepted[rows]
        fresh = torch.multinomial(target_probs[rows, pos], 1, generator=default_generator)
        res.output_token_ids[rows, pos] = fresh.squeeze(1)
    return res


def _stale_bonus(target_probs, target_argmax, draft_token_ids, draft_probs, num_draft_host,
                 greedy, generators, default_generator, **kwargs):
    """The real sampler, except that a bonus token is drawn from p_n instead of p_{n+1}."""
    res = rejection_sample(target_probs, target_argmax, draft_token_ids, draft_probs,
                           num_draft_host, greedy, generators, default_generator, **kwargs)
    if target_probs is None:
        return res
    num_draft = torch.tensor(num_draft_host, device=res.num_accepted.device)
    rows = ((res.num_accepted == num_draft) & (num_draft > 0) & ~greedy).nonzero().squeeze(1)
    if rows.numel():
        pos = res.num_accepted[rows]
        fresh = torch.multinomial(target_probs[rows, pos - 1], 1, generator=default_generator)
        res.output_token_ids[rows, pos] = fresh.squeeze(1)
    return res


# wrong sampler -> the (x_t, x_{t+1}) pairs (0-based t) it must visibly break. A stale bonus
# shows in (x4, x5): the first speculative step's bonus, after 3 accepted proposals.
WRONG_SAMPLERS = {"recover_from_p": (_recover_from_p, (0, 1, 2)),
                  "stale_bonus": (_stale_bonus, (3,))}


@pytest.fixture(scope="module")
def exact(models) -> dict[float, torch.Tensor]:
    conds = _conditionals(models[0])
    return {top_p: _exact_joint(conds, top_p) for top_p in (1.0, TOP_P)}


def test_speculative_sampling_matches_target_law(models, exact) -> None:
    """k = 3 proposals per step, unseeded requests, top_p 1.0 and 0.8 in the same batches."""
    samples, metrics = _generate(models, (1.0, TOP_P), seed=0, fixed_k=True)
    # Every sequence speculates on its first decode step (3 proposals) at least.
    _check_speculation_ran(metrics, min_draft_tokens=2 * NUM_SAMPLES * NUM_SPECULATIVE_TOKENS)
    for top_p, tokens in samples.items():
        pvalues = _pair_pvalues(tokens, exact[top_p])
        assert min(pvalues) > PASS_P, f"top_p={top_p}: pair p-values {pvalues}"
    # top_p=0.8 really truncates: some tokens are impossible and never sampled.
    assert bool((exact[TOP_P] == 0).any())


def test_adaptive_speculation_with_seeded_requests_matches_target_law(models, exact) -> None:
    """The default engine (adaptive k) on seeded requests: each draws from its own generator."""
    samples, metrics = _generate(models, (1.0,), seed=1, fixed_k=False, request_seeds=True)
    _check_speculation_ran(metrics, min_draft_tokens=NUM_SAMPLES)
    pvalues = _pair_pvalues(samples[1.0], exact[1.0])
    assert min(pvalues) > PASS_P, f"pair p-values {pvalues}"


@pytest.mark.parametrize("wrong", sorted(WRONG_SAMPLERS))
def test_wrong_sampler_breaks_the_law(models, exact, monkeypatch, wrong: str) -> None:
    """Power: the same test, same seed, rejects an engine with a subtly wrong sampler."""
    sampler, broken_pairs = WRONG_SAMPLERS[wrong]
    monkeypatch.setattr(verifier, "rejection_sample", sampler)
    samples, metrics = _generate(models, (1.0, TOP_P), seed=0, fixed_k=True)
    _check_speculation_ran(metrics, min_draft_tokens=2 * NUM_SAMPLES * NUM_SPECULATIVE_TOKENS)
    for top_p, tokens in samples.items():
        pvalues = _pair_pvalues(tokens, exact[top_p])
        worst = max(pvalues[t] for t in broken_pairs)
        assert worst < FAIL_P, f"{wrong} passed at top_p={top_p}: pair p-values {pvalues}"
