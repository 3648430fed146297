"""Lossless acceptance of proposed tokens (speculative sampling, Leviathan et al. / Chen et al.).

For each sequence with ``n`` proposals ``x_1..x_n`` (drawn from the proposer's distributions
``q_1..q_n``) and the target's distributions ``p_1..p_{n+1}`` (after every sampling transform):

* accept ``x_j`` with probability ``min(1, p_j(x_j) / q_j(x_j))``, in order, until one is rejected;
* at the first rejection ``j`` emit a token drawn from ``norm(max(p_j - q_j, 0))``;
* if all ``n`` are accepted emit a bonus token drawn from ``p_{n+1}``.

The emitted tokens are then distributed exactly as if drawn one by one from the target. A
proposer without a distribution (n-gram lookup, greedy drafts) is a point mass: ``q(x) = 1``.
Greedy sequences take the fast path: accept while the proposal equals ``argmax p``, then emit
``argmax p``. Every random sequence consumes exactly its own number of proposals in uniforms and
one ``[V]`` exponential vector per step (from its own generator when it has one; greedy rows draw
nothing), so a seeded request's output never depends on its batch mates.

A sequence with zero proposals reduces to ordinary sampling of one token, so the engine sends
every sampled sequence through here.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from specserve.sample.sampler import exponential_noise
from specserve.worker.transfer import to_device

PAD_TOKEN = -1


@dataclass
class AcceptanceResult:
    output_token_ids: Tensor  # [S, K+1] int64, PAD_TOKEN past each row's emitted tokens
    num_emitted: Tensor  # [S] int64, 1..num_draft+1
    num_accepted: Tensor  # [S] int64, proposals accepted (num_emitted - 1)


def _uniforms(num_draft: list[int], k: int, device, generators, default_generator,
              random_rows: list[bool]) -> Tensor:
    """[S, K] uniforms. Each random sequence draws exactly its own num_draft values (seeded
    ones from their own generator, the others in row order from one batched draw); greedy
    rows draw nothing. So no sequence's random stream depends on how many proposals its batch
    mates got, which keeps runs reproducible even when k adapts to measured step times."""
    u = torch.zeros(len(num_draft), k, device=device, dtype=torch.float32)
    shared = [(i, n) for i, n in enumerate(num_draft)
              if random_rows[i] and generators[i] is None and n]
    if shared:
        draws = torch.empty(sum(n for _, n in shared), device=device).uniform_(
            generator=default_generator)
        offset = 0
        for i, n in shared:
            u[i, :n] = draws[offset : offset + n]
            offset += n
    for i, n in enumerate(num_draft):
        if random_rows[i] and generators[i] is not None and n:
            u[i, :n].uniform_(generator=generators[i])
    return u


def _first_rejection(accepted: Tensor, num_draft: Tensor) -> Tensor:
    """[S, K] bool acceptances -> [S] index of the first rejection (num_draft if none)."""
    k = accepted.shape[1]
    if k == 0:
        return num_draft.clone()
    positions = torch.arange(k, device=accepted.device)
    valid = positions[None, :] < num_draft[:, None]
    rejected = valid & ~accepted
    # argmax over a bool finds the first True; rows with none fall back to num_draft.
    first = torch.where(rejected.any(dim=1), rejected.int().argmax(dim=1), num_draft)
    return first


def _assemble(draft_token_ids: Tensor, first: Tensor, stop_token: Tensor) -> AcceptanceResult:
    """[accepted proposals..., stop token] per row, PAD_TOKEN after."""
    num_seqs, k = draft_token_ids.shape
    device = draft_token_ids.device
    rows = torch.arange(num_seqs, device=device)
    out = torch.full((num_seqs, k + 1), PAD_TOKEN, dtype=torch.long, device=device)
    if k:
        keep = torch.arange(k, device=device)[None, :] < first[:, None]
        out[:, :k] = torch.where(keep, draft_token_ids, out[:, :k])
    out[rows, first] = stop_token
    return AcceptanceResult(out, first + 1, first)


def greedy_accept(target_argmax: Tensor, draft_token_ids: Tensor,
                  num_draft: Tensor) -> AcceptanceResult:
    """Accept while the proposal equals the target's argmax, then emit the target's argmax."""
    k = draft_token_ids.shape[1]
    first = _first_rejection(draft_token_ids == target_argmax[:, :k], num_draft)
    rows = torch.arange(first.shape[0], device=first.device)
    return _assemble(draft_token_ids, first, target_argmax[rows, first])


def rejection_sample(
    target_probs: Tensor | None,  # [S, K+1, V] float32 p after all transforms; None: all greedy
    target_argmax: Tensor,  # [S, K+1] int64: argmax of the final logits (greedy rows)
    draft_token_ids: Tensor,  # [S, K] int64, PAD_TOKEN past num_draft
    draft_probs: Tensor | None,  # [S, K, V] float32 q, or None for point-mass proposals
    num_draft_host: list[int],  # [S] proposals per sequence
    greedy: Tensor,  # [S] bool
    generators: list[torch.Generator | None],
    default_generator: torch.Generator | None,
    acceptance: str = "rejection_sampler",
    posterior_threshold: float = 0.09,
    posterior_alpha: float = 0.3,
    random_rows: list[bool] | None = None,  # host copy of ~greedy (None: all random)
) -> AcceptanceResult:
    device = target_argmax.device
    num_draft = to_device(num_draft_host, torch.long, device)
    if target_probs is None:
        return greedy_accept(target_argmax, draft_token_ids, num_draft)
    num_seqs, k_plus_1, vocab = target_probs.shape
    k = k_plus_1 - 1
    safe_draft = draft_token_ids.clamp(min=0)  # [S, K]
    random_rows = random_rows if random_rows is not None else [True] * num_seqs
    uniforms = _uniforms(num_draft_host, k, device, generators, default_generator,
                         random_rows)  # [S, K]
    noise = exponential_noise(num_seqs, vocab, device, generators, default_generator,
                              needs_noise=random_rows)  # [S, V]

    # --- acceptance per position -----------------------------------------------------------
    p_of_x = target_probs[:, :k].gather(2, safe_draft[..., None]).squeeze(2)  # [S, K]
    if acceptance == "typical_acceptance_sampler":
        # Lossy (documented): accept tokens the target finds typical enough.
        entropy = -(target_probs[:, :k] * torch.log(target_probs[:, :k] + 1e-10)).sum(-1)
        threshold = torch.minimum(torch.full_like(entropy, posterior_threshold),
                                  posterior_alpha * torch.exp(-entropy))
        random_accept = p_of_x > threshold
    else:
        if draft_probs is None:
            q_of_x = torch.ones_like(p_of_x)
        else:
            q_of_x = draft_probs.gather(2, safe_draft[..., None]).squeeze(2)  # [S, K]
        random_accept = uniforms * q_of_x < p_of_x  # u < p/q without dividing by q
    matches_argmax = draft_token_ids == target_argmax[:, :k]  # [S, K]
    accepted = torch.where(greedy[:, None], matches_argmax, random_accept)
    first = _first_rejection(accepted, num_draft)  # [S]

    # --- the token emitted at the stop position ------------------------------------------
    rows = torch.arange(num_seqs, device=device)
    p_stop = target_probs[rows, first]  # [S, V]
    is_rejection = first < num_draft  # [S]
    if k == 0:
        stop_dist = p_stop  # nothing proposed: an ordinary sample
    elif acceptance == "typical_acceptance_sampler":
        # Lossy variant (as vLLM): a rejected position takes the target's most likely token.
        residual = torch.zeros_like(p_stop)
        residual[rows, target_argmax[rows, first]] = 1.0
        stop_dist = torch.where(is_rejection[:, None], residual, p_stop)
    else:
        stop_pos = first.clamp(max=k - 1)  # [S]; only used where is_rejection
        if draft_probs is None:
            q_stop = torch.zeros_like(p_stop)
            q_stop[rows, safe_draft[rows, stop_pos]] = 1.0  # point-mass proposal
        else:
            q_stop = draft_probs[rows, stop_pos]  # [S, V]
        residual = (p_stop - q_stop).clamp_(min=0.0)
        empty = residual.sum(dim=1, keepdim=True) <= 0  # p == q: fall back to p
        residual = torch.where(empty, p_stop, residual)
        stop_dist = torch.where(is_rejection[:, None], residual, p_stop)  # unnormalised is ok
    random_token = (stop_dist / noise).argmax(dim=1)  # exponential race = a draw from stop_dist
    greedy_token = target_argmax[rows, first]
    stop_token = torch.where(greedy, greedy_token, random_token)  # [S]

    return _assemble(draft_token_ids, first, stop_token)
