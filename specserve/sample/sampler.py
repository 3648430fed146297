"""Draw tokens from final logits, and compute the logprobs that outputs report.

Random rows use the exponential race: argmax_i p_i / E_i with E_i ~ Exp(1) iid picks i with
probability exactly p_i, needs no cumulative sum or host sync, and lets each seeded row draw its
own noise from its own generator so its tokens do not depend on its batch mates.
"""

from __future__ import annotations

import torch
from torch import Tensor

from specserve.sample.logits_processing import SamplingTensors

# Floor for the exponential noise: a 0 draw would make p/E = nan (p = 0) or inf.
_MIN_NOISE = torch.finfo(torch.float32).tiny


def probs_from_final_logits(final_logits: Tensor) -> Tensor:
    """[R, V] final logits -> [R, V] float32 probabilities (the p and q of rejection sampling)."""
    return torch.softmax(final_logits, dim=-1, dtype=torch.float32)


def exponential_noise(
    num_rows: int,
    vocab_size: int,
    device: torch.device | str,
    generators: list[torch.Generator | None],
    default_generator: torch.Generator | None = None,
    needs_noise: list[bool] | None = None,
) -> Tensor:
    """[R, V] iid Exp(1) noise; row r comes from generators[r] when it is not None.

    Each seeded row draws exactly one [V] block from its generator, in row order, so the same
    seed produces the same noise whatever else is in the batch. Unseeded rows share one batched
    draw from `default_generator` (torch's default generator when None). Rows with
    needs_noise[r] False (greedy rows) draw nothing and get 1.0, so how many greedy rows share
    the batch never shifts the random stream of the others.
    """
    assert len(generators) == num_rows
    needs = needs_noise if needs_noise is not None else [True] * num_rows
    noise = torch.ones(num_rows, vocab_size, dtype=torch.float32, device=device)  # [R, V]
    unseeded = [r for r in range(num_rows) if needs[r] and generators[r] is None]
    if len(unseeded) == num_rows:
        noise.exponential_(generator=default_generator)
    elif unseeded:
        block = torch.empty(len(unseeded), vocab_size, dtype=torch.float32, device=device)
        noise[torch.tensor(unseeded, device=device)] = block.exponential_(
            generator=default_generator)
    for r in range(num_rows):
        if needs[r] and generators[r] is not None:
            noise[r].exponential_(generator=generators[r])
    return noise.clamp_(min=_MIN_NOISE)


def sample(
    final_logits: Tensor,
    t: SamplingTensors,
    generators: list[torch.Generator | None],
    default_generator: torch.Generator | None = None,
) -> Tensor:
    """[R, V] final logits (from `process_logits`) -> [R] int64 sampled token ids.

    Greedy rows take argmax (ties -> lowest index); random rows race exponentials against
    softmax(final_logits). No host sync.
    """
    greedy_tokens = None if t.all_random else final_logits.argmax(dim=-1)  # [R]
    if t.all_greedy:
        assert greedy_tokens is not None
        return greedy_tokens
    num_rows, vocab_size = final_logits.shape
    probs = probs_from_final_logits(final_logits)  # [R, V]
    noise = exponential_noise(num_rows, vocab_size, final_logits.device, generators,
                              default_generator, needs_noise=t.random_rows)  # [R, V]
    random_tokens = probs.div_(noise).argmax(dim=-1)  # [R]
    if greedy_tokens is None:
        return random_tokens
    return torch.where(t.greedy, greedy_tokens, random_tokens)


def compute_logprobs(raw_logits: Tensor) -> Tensor:
    """[R, V] float32 log-softmax of the model's raw logits.

    Reported logprobs describe the model's distribution (before temperature, penalties and
    filtering), matching OpenAI and vLLM v1's default.
    """
    return torch.log_softmax(raw_logits, dim=-1, dtype=torch.float32)


def gather_logprobs(
    logprobs: Tensor, token_ids: Tensor, num_top: int
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Logprob and rank of each row's token plus the row's top `num_top` tokens.

    Returns token_logprob [R] float32, token_rank [R] int64 (1-based: the number of tokens
    whose logprob is >= the token's, as vLLM counts, so ties rank at the worst position),
    top_ids [R, num_top] int64 and top_logprobs [R, num_top] float32 (descending).
    """
    token_logprob = logprobs.gather(1, token_ids.long().unsqueeze(1)).squeeze(1)  # [R]
    token_rank = (logprobs >= token_logprob.unsqueeze(1)).sum(dim=-1)  # [R]
    if num_top > 0:
        top_logprobs, top_ids = logprobs.topk(num_top, dim=-1)  # [R, num_top] each
    else:
        top_logprobs = logprobs.new_empty(logprobs.shape[0], 0)
        top_ids = torch.empty(logprobs.shape[0], 0, dtype=torch.long, device=logprobs.device)
    return token_logprob, token_rank, top_ids, top_logprobs
