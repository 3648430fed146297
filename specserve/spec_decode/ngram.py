"""Prompt-lookup ("[ngram]") speculation: copy what followed the last time the context's tail
appeared.

For each sequence, the longest trailing n-gram (ngram_prompt_lookup_max down to _min) is looked
up in the sequence's earlier tokens (prompt + output); the most recent earlier occurrence wins and
the tokens that followed it are proposed. No match means no proposal, and that sequence simply
decodes in the same step. Proposals are point masses (q(x) = 1), so sampled requests accept a
proposal with probability p(x), which keeps the output distribution exact.

Each sequence keeps an ``NgramIndex``: a dict from every n-gram it contains to the position of
the token after its most recent occurrence, grown by the tokens committed since the last step.
A lookup is then at most (n_max - n_min + 1) dict probes, whatever the context length: searching
the whole sequence every step (vectorised numpy over 32 sequences of ~200 tokens) cost ~3 ms per
engine step on the CI machine, ~2-3 % of a batch-32 decode step, and grows with the context.
"""

from __future__ import annotations

from specserve.engine.sequence import Sequence
from specserve.spec_decode.proposer import DraftProposals, Proposer


class NgramIndex:
    """The most recent occurrence of every n-gram (n_min <= n <= n_max) of one token sequence
    that has a token after it, kept up to date as the sequence grows (tokens are only ever
    appended: proposals never enter it, only committed tokens)."""

    def __init__(self, n_max: int, n_min: int) -> None:
        self.n_max, self.n_min = n_max, n_min
        self.follow: dict[tuple[int, ...], int] = {}  # n-gram -> index of the token after it
        self.next_end = 0  # n-grams ending before this index are indexed

    def update(self, tokens: list[int]) -> None:
        """Index the n-grams ending at positions next_end .. len - 2 (each has a follower)."""
        for end in range(self.next_end, len(tokens) - 1):
            for n in range(self.n_min, min(self.n_max, end + 1) + 1):
                self.follow[tuple(tokens[end - n + 1 : end + 1])] = end + 1
        self.next_end = max(self.next_end, len(tokens) - 1)

    def propose(self, tokens: list[int], k: int) -> list[int]:
        """Up to k tokens following the most recent earlier occurrence of the longest matching
        tail of tokens (the tail itself excluded); [] when none matches."""
        return self.match(tokens, k)[0]

    def match(self, tokens: list[int], k: int) -> tuple[list[int], int]:
        """(propose(tokens, k), the length n of the matched tail; 0 when none matches)."""
        self.update(tokens)
        length = len(tokens)
        for n in range(min(self.n_max, length - 1), self.n_min - 1, -1):
            start = self.follow.get(tuple(tokens[length - n :]))
            if start is not None:
                return list(tokens[start : start + k]), n
        return [], 0


def find_ngram_proposal(tokens: list[int], n_max: int, n_min: int, k: int) -> list[int]:
    """One lookup over a whole token list (what a fresh sequence's first step does)."""
    return NgramIndex(n_max, n_min).propose(list(tokens), k)


class NgramProposer(Proposer):
    has_probs = False

    def __init__(self, prompt_lookup_max: int, prompt_lookup_min: int) -> None:
        self.n_max = prompt_lookup_max
        self.n_min = prompt_lookup_min
        self._indexes: dict[int, NgramIndex] = {}  # seq_id -> its index

    def propose(self, seqs: list[Sequence], max_tokens: list[int],
                on_device: bool = False) -> DraftProposals:
        out, lengths = [], []
        for seq, k in zip(seqs, max_tokens, strict=True):
            if k <= 0:
                out.append([])
                lengths.append(0)
                continue
            index = self._indexes.get(seq.seq_id)
            if index is None:
                index = self._indexes[seq.seq_id] = NgramIndex(self.n_max, self.n_min)
            tokens, n = index.match(seq.token_ids, k)
            out.append(tokens)
            lengths.append(n)
        return DraftProposals(out, None, match_lengths=lengths)

    def free(self, seq: Sequence) -> None:
        self._indexes.pop(seq.seq_id, None)
