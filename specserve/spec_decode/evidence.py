"""Acceptance by evidence class: how often a draft-free proposal is accepted, given how much of
the context its lookup matched.

Why: an n-gram or suffix-tree proposal says how strong its evidence is, the length of the
context tail it matched, and that length predicts acceptance far better than a sequence's
recent history. SmolLM2-135M-Instruct, greedy, prompt lookup (n <= 8) over 12 HumanEval
edit prompts, P(first j proposals accepted) at every output position:

    matched n = 1:  0.20  0.10  0.06  0.03   (j = 1..4)
    matched n = 2:  0.55  0.39  0.27  0.22
    matched n = 4:  0.76  0.62  0.52  0.50
    matched n >= 8: 0.94  0.89  0.83  0.79

(chat prompts: 0.16 at n = 1, 0.84 at n = 4). A sequence's moving averages (adaptive.py) mix
these classes, so the policy proposed too little after long matches and too much after short
ones. Replaying the same outputs with the runner's measured cost of each row count on the CPU,
choosing k by class (learned on 6 prompts, applied to 6 others) reached 1.89x plain decoding's
tokens per unit of step cost with n <= 4 and 1.98x with n <= 8, a fixed k = 3 1.82x (choosing
each step's k with hindsight: 2.2x). In the engine, paired runs on those 6 prompts at batch 1:
"[ngram]" k = 5 went from 1.70-1.73x to 1.80-1.81x; "[suffix]" (whose proposals are already
as long as their match) and batch 32 stayed within the machine's noise.

The model: per class c and depth j, decayed counts of proposals that reached depth j (their
first j - 1 tokens accepted) and of those whose j-th token was accepted too. The rate at depth
j is (accepted + w * prior) / (reached + w), the prior being the sequence's own averages (its
first-proposal rate at j = 1, its continuation rate after), w = PRIOR_WEIGHT pseudo-trials,
so a class with little data follows the sequence, and a class seen often follows its own
counts; P(proposals 1..j accepted) is the product of the rates up to j. Counts decay by DECAY
per proposal of their class, so they follow the text a batch is on. Classes are engine-wide:
only unpinned (greedy) sequences use them, because a sampled request's k must not depend on
other requests (adaptive.py, "pinned").
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

DECAY = 0.98  # per proposal of a class: its counts weigh the last ~50 of them
PRIOR_WEIGHT = 2.0  # pseudo-trials of the sequence's own averages in every rate
MAX_DEPTH = 32  # depths tracked per class; deeper proposals use the deepest rate
EXACT_CLASSES = 8  # match lengths 1..8 are classes of their own, longer ones share buckets
LENGTH_CLASSES = EXACT_CLASSES + 2 + int(2 * math.log2(64 / EXACT_CLASSES))  # buckets to 64
NUM_CLASSES = 3 * LENGTH_CLASSES  # ... and the same again for aligned and for LOOKUP proposals
# Flag bit of an evidence int: the proposal's occurrence was chosen by the copy alignment
# (ngram.AlignedNgramIndex), not as the most recent one. After a 1-token match such an
# occurrence's first token was accepted 32 % of the time, a most recent one (none aligned) 12 %
# (SmolLM2 on 64 HumanEval edit prompts), so the two share no class. Evidence travels as one
# int (match length | flag) from the proposer through the driver to the policy, like the plain
# match length it extends.
ALIGNED = 1 << 16
# Flag bit: a lookup proposal from the most recent occurrence made beside suffix trees ("[suffix]"
# with the aligned lookup, hybrid.py). There plain match lengths are the suffix trees', whose
# first proposals were accepted about twice as often after a 1-token match (SmolLM2, 32
# HumanEval edit prompts: 21-29 % against 12 %), so the lookup's keep classes of their own.
LOOKUP = 1 << 17


def aligned_evidence(match_length: int) -> int:
    """The evidence of a proposal whose occurrence the copy alignment chose."""
    return match_length | ALIGNED


def evidence_class(evidence: int) -> int:
    """The class of a proposal's evidence: its match length itself up to EXACT_CLASSES, then
    ~41 % wide buckets (9-11, 12-15, 16-22, 23-31, ...), the last one open from 64 (0: no
    match); aligned proposals (ALIGNED) in a second, equal range of classes, LOOKUP ones in a
    third."""
    offset = (LENGTH_CLASSES if evidence & ALIGNED
              else 2 * LENGTH_CLASSES if evidence & LOOKUP else 0)
    match_length = evidence & (ALIGNED - 1) if evidence > 0 else 0
    if match_length <= EXACT_CLASSES:
        return offset + match_length if match_length > 0 else 0
    bucket = int(2 * math.log2(match_length / EXACT_CLASSES))
    return offset + min(EXACT_CLASSES + 1 + bucket, LENGTH_CLASSES - 1)


@dataclass
class EvidenceAcceptance:
    # [class, depth]: decayed counts of proposals that reached depth j + 1, and of those
    # whose token at depth j + 1 was accepted
    reached: np.ndarray = field(default_factory=lambda: np.zeros((NUM_CLASSES, MAX_DEPTH)))
    accepted: np.ndarray = field(default_factory=lambda: np.zeros((NUM_CLASSES, MAX_DEPTH)))
    _cache: dict[int, tuple[list[float], list[float]]] = field(default_factory=dict)  # by class

    def record(self, match_length: int, num_proposed: int, num_accepted: int) -> None:
        """One verified (or shadow-scored) proposal of num_proposed tokens whose first
        num_accepted were accepted."""
        if num_proposed <= 0 or match_length <= 0:
            return
        c = evidence_class(match_length)
        self._cache.pop(c, None)
        self.reached[c] *= DECAY
        self.accepted[c] *= DECAY
        depth = min(num_accepted + 1, num_proposed, MAX_DEPTH)
        self.reached[c, :depth] += 1.0
        self.accepted[c, : min(num_accepted, MAX_DEPTH)] += 1.0

    def gains(self, match_length: int, own: list[float], k: int) -> list[float]:
        """P(proposals 1..j all accepted), j = 1..k, for a proposal whose evidence matched
        match_length tokens; own = the sequence's averages [first-proposal rate, continuation
        rate], the prior of every rate. Plain Python over cached lists: this runs for every
        proposing sequence every step, and numpy's per-call overhead on arrays this small cost
        ~0.1 ms per step at batch 1 (1 % of a step)."""
        reached, accepted = self._lists(evidence_class(match_length))
        first, cont = own[0], own[1]
        out, gain = [], 1.0
        for j in range(k):
            d = min(j, MAX_DEPTH - 1)
            prior = first if j == 0 else cont
            gain *= (accepted[d] + PRIOR_WEIGHT * prior) / (reached[d] + PRIOR_WEIGHT)
            out.append(gain)
        return out

    def _lists(self, c: int) -> tuple[list[float], list[float]]:
        cached = self._cache.get(c)
        if cached is None:
            cached = self._cache[c] = (self.reached[c].tolist(), self.accepted[c].tolist())
        return cached
