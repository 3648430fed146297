"""Prompt-lookup ("[ngram]") speculation: copy what followed the last time the context's tail
appeared.

For each sequence, the longest trailing n-gram (ngram_prompt_lookup_max down to _min) is looked
up in the sequence's earlier tokens (prompt + output); the most recent earlier occurrence wins and
the tokens that followed it are proposed. No match means no proposal, and that sequence simply
decodes in the same step. Proposals are point masses (q(x) = 1), so sampled requests accept a
proposal with probability p(x), which keeps the output distribution exact.

The search is one vectorised comparison per n over the sequence (numpy), O(len * n) without any
Python loop over positions.
"""

from __future__ import annotations

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view

from specserve.engine.sequence import Sequence
from specserve.spec_decode.proposer import DraftProposals, Proposer


def find_ngram_proposal(tokens: np.ndarray, n_max: int, n_min: int, k: int) -> list[int]:
    """Tokens following the most recent earlier occurrence of the longest matching tail."""
    length = tokens.shape[0]
    for n in range(min(n_max, length - 1), n_min - 1, -1):
        tail = tokens[length - n :]
        # Candidate windows start at 0..length-n-1 (the tail itself is excluded).
        windows = sliding_window_view(tokens[: length - 1], n)  # [length - n, n]
        hits = np.flatnonzero((windows == tail).all(axis=1))
        if hits.size:
            start = int(hits[-1]) + n  # first token after the most recent match
            return tokens[start : start + k].tolist()
    return []


class NgramProposer(Proposer):
    has_probs = False

    def __init__(self, prompt_lookup_max: int, prompt_lookup_min: int) -> None:
        self.n_max = prompt_lookup_max
        self.n_min = prompt_lookup_min

    def propose(self, seqs: list[Sequence], max_tokens: list[int]) -> DraftProposals:
        out = []
        for seq, k in zip(seqs, max_tokens, strict=True):
            if k <= 0:
                out.append([])
                continue
            tokens = np.asarray(seq.token_ids, dtype=np.int64)
            out.append(find_ngram_proposal(tokens, self.n_max, self.n_min, k))
        return DraftProposals(out, None)
