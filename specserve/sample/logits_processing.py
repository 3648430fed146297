"""Turn a model's raw logits into the exact distribution each row samples from.

A row is one scored position; a request can own several rows in one step (k+1 of them while a
speculative proposal is verified), so every parameter is a per-row tensor. `process_logits` is
the single definition of "the distribution a request asks for": the sampler draws from its
softmax and the rejection sampler uses the same softmax as the target (and draft) distribution.
If these ever diverged, speculative decoding would stop being lossless.

Order (vLLM v0 / Hugging Face order): logit bias and blocking -> penalties -> temperature ->
top-k -> top-p -> min-p.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import torch
from torch import Tensor

from specserve.sampling_params import SAMPLING_EPS, SamplingParams
from specserve.worker.transfer import to_device

NEG_INF = float("-inf")


def _row_token_index(
    token_ids: list[list[int]], rows: list[int], device: torch.device
) -> tuple[Tensor, Tensor]:
    """Flatten the token lists of `rows` into parallel (row, token) index tensors."""
    row_idx = list(itertools.chain.from_iterable([r] * len(token_ids[r]) for r in rows))
    tok_idx = list(itertools.chain.from_iterable(token_ids[r] for r in rows))
    return (
        to_device(row_idx, torch.long, device),
        to_device(tok_idx, torch.long, device),
    )


@dataclass
class SamplingTensors:
    """Per-row sampling parameters as device tensors, built once per step.

    Rows whose parameter is disabled hold the neutral value (top_k=vocab_size, top_p=1,
    min_p=0, penalties 0/0/1), so one vectorised pass is correct for every row; the host flags
    only let a whole transform be skipped when no row needs it.
    """

    temperature: Tensor  # [R] float, 0.0 for greedy rows
    top_k: Tensor  # [R] int64, vocab_size when disabled
    top_p: Tensor  # [R] float, 1.0 when disabled
    min_p: Tensor  # [R] float, 0.0 when disabled
    presence_penalty: Tensor  # [R] float
    frequency_penalty: Tensor  # [R] float
    repetition_penalty: Tensor  # [R] float
    # [R, V] int32 count of each token in the row's output so far; rows without penalties are
    # all zero (their penalties are neutral anyway). None when no row uses penalties.
    output_token_counts: Tensor | None
    prompt_token_mask: Tensor | None  # [R, V] bool, token occurs in the prompt (rep. penalty)
    logit_bias: Tensor | None  # [R, V] float additive; -inf forbids a token
    greedy: Tensor  # [R] bool
    all_greedy: bool
    all_random: bool
    no_penalties: bool
    no_top_k: bool
    no_top_p: bool
    no_min_p: bool
    random_rows: list[bool] | None = None  # host copy of ~greedy, to draw noise only there

    @property
    def num_rows(self) -> int:
        return self.greedy.shape[0]

    @classmethod
    def from_rows(
        cls,
        params: list[SamplingParams],
        output_token_ids: list[list[int]],
        prompt_token_ids: list[list[int]],
        vocab_size: int,
        device: torch.device | str,
        dtype: torch.dtype = torch.float32,
        blocked_token_ids: list[list[int]] | None = None,
    ) -> SamplingTensors:
        """Build the tensors for one step.

        `output_token_ids[r]` are the tokens generated before row r's position (for a
        verification row this includes the proposals in front of it). `blocked_token_ids[r]`
        are ids forbidden at row r, e.g. EOS/stop ids while fewer than min_tokens were made.
        Token ids that index logits (logit_bias, allowed_token_ids) must be < vocab_size
        (`SamplingParams.verify_vocab`); out-of-range blocked/prompt/output ids are ignored.
        `dtype` below float32 (e.g. the model's bf16) is raised to float32: final logits are
        float32, and a bf16 top_p of 0.9 would really be 0.8984.
        """
        if dtype not in (torch.float32, torch.float64):
            dtype = torch.float32
        num_rows = len(params)
        assert len(output_token_ids) == num_rows and len(prompt_token_ids) == num_rows
        assert blocked_token_ids is None or len(blocked_token_ids) == num_rows
        device = torch.device(device)

        greedy = [p.temperature < SAMPLING_EPS for p in params]
        top_k = [p.top_k if 0 < p.top_k < vocab_size else vocab_size for p in params]
        scalars = to_device(
            [
                [0.0 if g else p.temperature for p, g in zip(params, greedy, strict=True)],
                [p.top_p for p in params],
                [p.min_p for p in params],
                [p.presence_penalty for p in params],
                [p.frequency_penalty for p in params],
                [p.repetition_penalty for p in params],
            ],
            torch.float64, device,
        ).to(dtype)  # [6, R]

        penalty_rows = [r for r, p in enumerate(params) if p.uses_penalties]
        counts = prompt_mask = None
        if penalty_rows:
            counts = _token_counts(output_token_ids, penalty_rows, num_rows, vocab_size, device)
            if any(params[r].repetition_penalty != 1.0 for r in penalty_rows):
                prompt_mask = _token_counts(
                    prompt_token_ids, penalty_rows, num_rows, vocab_size, device
                ) > 0

        return cls(
            temperature=scalars[0],
            top_k=to_device(top_k, torch.long, device),
            top_p=scalars[1],
            min_p=scalars[2],
            presence_penalty=scalars[3],
            frequency_penalty=scalars[4],
            repetition_penalty=scalars[5],
            output_token_counts=counts,
            prompt_token_mask=prompt_mask,
            logit_bias=_logit_bias(params, blocked_token_ids, vocab_size, device, dtype),
            greedy=to_device(greedy, torch.bool, device),
            all_greedy=all(greedy),
            all_random=not any(greedy),
            no_penalties=not penalty_rows,
            no_top_k=all(k == vocab_size for k in top_k),
            no_top_p=all(p.top_p >= 1.0 for p in params),
            no_min_p=all(p.min_p <= 0.0 for p in params),
            random_rows=[not g for g in greedy],
        )


def _token_counts(
    token_ids: list[list[int]], rows: list[int], num_rows: int, vocab_size: int,
    device: torch.device,
) -> Tensor:
    """[R, V] int32 occurrence counts of each row's tokens (only `rows` filled)."""
    row_idx, tok_idx = _row_token_index(token_ids, rows, device)
    # One spare column absorbs ids >= vocab_size (added tokens the lm_head cannot emit).
    counts = torch.zeros(num_rows, vocab_size + 1, dtype=torch.int32, device=device)
    tok_idx = tok_idx.clamp_(max=vocab_size)
    ones = torch.ones_like(tok_idx, dtype=torch.int32)
    counts.index_put_((row_idx, tok_idx), ones, accumulate=True)
    return counts[:, :vocab_size]  # [R, V]


def _logit_bias(
    params: list[SamplingParams], blocked: list[list[int]] | None, vocab_size: int,
    device: torch.device, dtype: torch.dtype,
) -> Tensor | None:
    """[R, V] additive bias merging logit_bias, allowed_token_ids and blocked ids; or None."""
    allowed_rows = [r for r, p in enumerate(params) if p.allowed_token_ids is not None]
    bias_rows = [r for r, p in enumerate(params) if p.logit_bias]
    blocked_rows = [r for r in range(len(params)) if blocked and blocked[r]]
    if not (allowed_rows or bias_rows or blocked_rows):
        return None
    bias = torch.zeros(len(params), vocab_size, dtype=dtype, device=device)  # [R, V]
    if allowed_rows:
        rows = torch.tensor(allowed_rows, dtype=torch.long).to(device)
        bias[rows] = NEG_INF
        ids = [params[r].allowed_token_ids or [] for r in range(len(params))]
        row_idx, tok_idx = _row_token_index(ids, allowed_rows, device)
        bias[row_idx, tok_idx] = 0.0
    if bias_rows:
        row_idx, tok_idx = _row_token_index(
            [list(p.logit_bias or ()) for p in params], bias_rows, device)
        vals = [v for r in bias_rows for v in params[r].logit_bias.values()]
        vals_t = torch.tensor(vals, dtype=dtype).to(device)
        bias.index_put_((row_idx, tok_idx), vals_t, accumulate=True)  # -inf + v stays -inf
    if blocked_rows:
        assert blocked is not None
        in_vocab = [[t for t in ids if 0 <= t < vocab_size] for ids in blocked]
        row_idx, tok_idx = _row_token_index(in_vocab, blocked_rows, device)
        bias[row_idx, tok_idx] = NEG_INF
    return bias


def apply_penalties(logits: Tensor, t: SamplingTensors) -> Tensor:
    """Repetition, frequency and presence penalties with vLLM semantics (out of place).

    Repetition: for tokens seen in the prompt or the output, divide positive logits by the
    penalty and multiply non-positive ones. Frequency: subtract penalty * output count.
    Presence: subtract penalty once if the token occurs in the output.
    """
    counts = t.output_token_counts  # [R, V]
    assert counts is not None, "output_token_counts is built whenever a row uses penalties"
    in_output = counts > 0  # [R, V]
    if t.prompt_token_mask is not None:
        seen = in_output | t.prompt_token_mask  # [R, V]
        rep = t.repetition_penalty.unsqueeze(1)  # [R, 1]
        penalised = torch.where(logits > 0, logits / rep, logits * rep)
        logits = torch.where(seen, penalised, logits)
    logits = logits - t.frequency_penalty.unsqueeze(1) * counts
    return logits - t.presence_penalty.unsqueeze(1) * in_output


def apply_temperature(logits: Tensor, t: SamplingTensors) -> Tensor:
    """Divide by temperature; greedy rows are divided by 1 so their argmax is untouched."""
    divisor = torch.where(t.greedy, torch.ones_like(t.temperature), t.temperature)  # [R]
    return logits / divisor.unsqueeze(1)


def apply_top_k_top_p(
    logits: Tensor, top_k: Tensor | None, top_p: Tensor | None
) -> Tensor:
    """Mask to -inf outside top-k, then outside the top-p nucleus (one sort for both).

    Top-k keeps every token whose logit ties the k-th largest (like Hugging Face). Top-p
    removes tokens whose ascending cumulative probability is <= 1 - p, always keeping the
    largest, computed on the top-k-filtered distribution (vLLM / Hugging Face semantics).
    """
    vocab_size = logits.shape[-1]
    sorted_logits, sorted_idx = logits.sort(dim=-1, descending=False)  # [R, V] each
    if top_k is not None:
        kth = sorted_logits.gather(1, (vocab_size - top_k).unsqueeze(1))  # [R, 1]
        sorted_logits = sorted_logits.masked_fill(sorted_logits < kth, NEG_INF)
    if top_p is not None:
        cum_probs = sorted_logits.softmax(dim=-1).cumsum(dim=-1)  # [R, V]
        remove = cum_probs <= (1.0 - top_p).unsqueeze(1)  # [R, V]
        remove &= (top_p < 1.0).unsqueeze(1)  # rows with top_p disabled keep everything
        remove[:, -1] = False
        sorted_logits = sorted_logits.masked_fill(remove, NEG_INF)
    return torch.empty_like(logits).scatter_(1, sorted_idx, sorted_logits)


def apply_min_p(logits: Tensor, min_p: Tensor) -> Tensor:
    """Mask tokens with prob < min_p * max prob, compared in log space (no softmax needed).

    p_i < min_p * p_max  <=>  logit_i < logit_max + log(min_p); min_p = 0 gives -inf, a no-op.
    """
    threshold = logits.amax(dim=-1, keepdim=True) + torch.log(min_p).unsqueeze(1)  # [R, 1]
    return logits.masked_fill(logits < threshold, NEG_INF)


def process_logits(logits: Tensor, t: SamplingTensors) -> Tensor:
    """[R, V] raw logits -> [R, V] float32 final logits; softmax of the result is the
    distribution each row samples from. Never mutates `logits` (raw logprobs need it) but may
    return it unchanged when no row needs any transform.
    """
    logits = logits.float()
    if t.logit_bias is not None:
        logits = logits + t.logit_bias
    if not t.no_penalties:
        logits = apply_penalties(logits, t)
    if not t.all_greedy:
        logits = apply_temperature(logits, t)
    if not (t.no_top_k and t.no_top_p):
        logits = apply_top_k_top_p(
            logits,
            None if t.no_top_k else t.top_k,
            None if t.no_top_p else t.top_p,
        )
    if not t.no_min_p:
        logits = apply_min_p(logits, t.min_p)
    return logits
