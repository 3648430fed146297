"""Suffix decoding and aligned prompt lookup side by side: each step, each sequence proposes the
candidate of whichever source has lately been right more often for evidence like its own.

Why: the two find different things. Suffix trees (suffix.py) propose by frequency over the
request and over earlier requests' outputs, so they know the boilerplate an answer repeats;
aligned prompt lookup (ngram.AlignedNgramIndex) follows the place in the prompt that an
edited copy is copying from. On SmolLM2's greedy answers to the 32 grounded benchmark prompts
(benchmarks/bench_draft_free_cpu.py), of 3377 positions only suffix's first token was accepted
at 203, only the lookup's at 151, and where both were, their runs differed in length: with
hindsight, the better of the two at every position would make 2.54x plain decoding against
2.24-2.32x for either alone (this CPU's pass cost by rows); the engine's adaptive policy
replayed over what this proposer chooses makes 2.00x, over either source alone 1.92-1.93x
(benchmarks/grounded_ceiling.py). In the engine, the fastest of 3 runs per prompt, it read
1.94-2.05x against 1.93-1.94x for "[suffix]" alone in three runs (BENCHMARKS.md, CPU, session
39), and 2.08-2.17x against 2.05-2.11x in two runs once the head's greedy screen made
verification cheaper (session 40): ahead by 0.5-6 % in four runs, behind by 1.4 % in one, so
it is opt-in.

The choice: per (source, evidence class) decayed counts of candidates made and of those whose
first token the text then took. Every candidate is scored, chosen or not: at a sequence's next
proposal its last step's candidates are compared with the tokens committed since (a point-mass
proposal's first token is accepted exactly when it is the committed token), so both sources
keep learning whichever one the sequence follows. The chosen candidate goes to the policy with
its own evidence (adaptive.py learns acceptance by evidence class and picks k). Whatever is
chosen, the output is exactly that of plain decoding (greedy) or has its distribution (sampled:
a point-mass proposal is accepted with probability p(x)). As with suffix decoding's cache of
earlier outputs, the counts are engine-wide, so which tokens a seeded sampled request is
offered, and hence its draws, can depend on what the engine ran before it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from specserve.engine.sequence import Sequence
from specserve.spec_decode.evidence import ALIGNED, LOOKUP, NUM_CLASSES, evidence_class
from specserve.spec_decode.ngram import NgramProposer
from specserve.spec_decode.proposer import DraftProposals, Proposer
from specserve.spec_decode.suffix import SuffixProposer

DECAY = 0.98  # per scored candidate of a (source, class): its counts weigh the last ~50
PRIOR_RATE = 0.5  # a (source, class) with no data: even odds
PRIOR_WEIGHT = 2.0  # pseudo-candidates of that prior in every rate
SOURCES = ("lookup", "suffix")
LOOKUP_SOURCE = SOURCES.index("lookup")


@dataclass
class _Pending:
    """A sequence's last candidates: made when it had `position` tokens."""

    position: int
    candidates: list[tuple[int, int, int]]  # (source, evidence class, first token)


@dataclass
class FirstTokenRates:
    """Decayed first-token acceptance per (source, evidence class)."""

    made: list[list[float]] = field(
        default_factory=lambda: [[0.0] * NUM_CLASSES for _ in SOURCES])
    taken: list[list[float]] = field(
        default_factory=lambda: [[0.0] * NUM_CLASSES for _ in SOURCES])

    def record(self, source: int, cls: int, accepted: bool) -> None:
        self.made[source][cls] = self.made[source][cls] * DECAY + 1.0
        self.taken[source][cls] = self.taken[source][cls] * DECAY + float(accepted)

    def rate(self, source: int, cls: int) -> float:
        return ((self.taken[source][cls] + PRIOR_WEIGHT * PRIOR_RATE)
                / (self.made[source][cls] + PRIOR_WEIGHT))


class HybridProposer(Proposer):
    """"[suffix]" with the aligned prompt lookup as a second source (module docstring)."""

    has_probs = False

    def __init__(self, suffix: SuffixProposer, lookup: NgramProposer) -> None:
        self.sources = (lookup, suffix)  # in SOURCES order
        self.suffix = suffix  # (its cache of earlier outputs: benchmarks reset it)
        self.rates = FirstTokenRates()
        self._pending: dict[int, _Pending] = {}  # seq_id -> its last candidates

    def propose(self, seqs: list[Sequence], max_tokens: list[int],
                on_device: bool = False) -> DraftProposals:
        found = [source.propose(seqs, max_tokens) for source in self.sources]
        out: list[list[int]] = []
        evidence: list[int] = []
        for i, seq in enumerate(seqs):
            self._score(seq)
            best: tuple[float, int, int, list[int]] | None = None  # rate, length, evidence
            candidates = []
            for s, proposals in enumerate(found):
                tokens = proposals.token_ids[i]
                if not tokens:
                    continue
                matched = proposals.match_lengths[i]
                if s == LOOKUP_SOURCE and not matched & ALIGNED:
                    matched |= LOOKUP  # not the suffix trees' plain match lengths (evidence.py)
                cls = evidence_class(matched)
                candidates.append((s, cls, tokens[0]))
                key = (self.rates.rate(s, cls), len(tokens))
                if best is None or key > best[:2]:
                    best = (*key, matched, tokens)
            if candidates:
                self._pending[seq.seq_id] = _Pending(seq.num_tokens, candidates)
            out.append([] if best is None else best[3])
            evidence.append(0 if best is None else best[2])
        return DraftProposals(out, None, match_lengths=evidence)

    def _score(self, seq: Sequence) -> None:
        """Score the sequence's last candidates against the token committed after them."""
        pending = self._pending.get(seq.seq_id)
        if pending is None or seq.num_tokens <= pending.position:
            return
        committed = seq.token_ids[pending.position]
        for source, cls, first in pending.candidates:
            self.rates.record(source, cls, first == committed)
        del self._pending[seq.seq_id]

    def free(self, seq: Sequence) -> None:
        self._pending.pop(seq.seq_id, None)
        for source in self.sources:
            source.free(seq)
