"""Plan-first speculation (a draft model): how far the whole batch speculates, by measured speedup.

Why not adaptive.py's per-proposal cost model, which serves draft-free methods: a draft
model's cost is mostly a fixed price per step (its forwards run for the whole batch however
many proposals there are; on an H200 at batch 32 a 1B draft's passes cost about 1.2x a plain
8B step whether 30 or 128 tokens are proposed), its declined proposals cannot be scored for
free, and a sequence that sits steps out makes the draft catch up on every token it skipped
(at batch 32 a catch-up step measured 4-10 plain steps). Choosing proposals one by one against
a cost curve interpolated from a few points left most sequences idle and paid for catch-ups,
and lost 10-20 % at acceptance 0.5-0.7 where speculation can win.

So the batch chooses a cap c on k (0: plain decoding) and every sequence proposes
min(c, its own k) tokens, at least one, which keeps the draft in step with all of them. What a
step with each cap costs is measured on the steps that ran it, as step time / plain step time
per batch-size bucket; what it brings comes from the sequences' acceptance averages (the
expected tokens per sequence). The planner runs the cap with the best predicted speedup and
tries each neighbour of it twice (speedup is unimodal in c: each further proposal is accepted
less often and costs more), and the largest cap twice while plain decoding is best (a draft
that only pays with several proposals) unless its cost, extrapolated from the measured caps,
rules it out. Measurements expire, so caps are tried again as load changes.

A batch that shrinks into a bucket with no measurements yet (requests finishing: the ragged end
of a batch whose sequences advanced at different speeds) borrows the measurements of the
nearest larger bucket instead of stepping plainly to measure and then trying caps one by one:
at batch 32 on the H200 those plain and exploring steps made the last ~16 steps of a run cost
6x what plain decoding's last 3 did, which cost more than speculation gained.

A closed batch (nobody waiting) is done when its slowest sequence is, and speculation makes the
sequences' paces random: plain decoding finishes 32 sequences of 128 tokens in 128 steps, but
at 1 + Bernoulli(0.5) tokens a step the slowest of 32 needs ~6 steps more than the mean pace's
85 (measured on the H200: the last 15-21 steps ran ever smaller batches at nearly the full
step time). ``makespan_stretch`` estimates that factor from the sequences' remaining tokens
and the variance of the tokens a step brings, and the planner divides the expected tokens of
each cap by it. At acceptance 0.5 with a 1B draft for an 8B target (c = 0.24) this turns a
predicted 1.10x into ~1.02x, below the margin, so a batch that knows its acceptance decodes
plainly; at 0.7 and 0.9 the stretch is 10-13 % and speculation still pays. (Measured at batch
32: 0.97x at 0.5, the one step in which a new batch learns its acceptance, with the draft's
prefill of every prompt; 1.09-1.11x and 1.39-1.58x at 0.7 and 0.9.)
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from statistics import NormalDist

import numpy as np

MIN_SPEEDUP = 1.02  # a cap must beat plain decoding by this much to be run (noise margin)
SWITCH_MARGIN = 1.03  # ... and turning speculation on or off must win by this much more
CAP_EXPIRY = 200  # steps after which a cap's speedup sample is dropped
CAP_SAMPLES = 8  # kept per (batch bucket, cap)
TRIES_PER_CAP = 2  # measured steps before a neighbour of the best cap is judged
MAX_BORROW_BUCKETS = 8  # a bucket borrows measurements from at most this many buckets up
MAX_UNLEARNED_BATCHES = 3  # new closed batches in a row that may skip learning (see below)
FRUITFUL_TOKENS = 48  # a learning batch still speculating this far in has learned something
LEARNING_SEQUENCES = 8  # sequences of a new closed batch whose first proposal its learning tries


@functools.cache
def expected_max_of_normals(n: int) -> float:
    """E[max of n independent standard normals] (Blom's approximation; 0 for n <= 1)."""
    return 0.0 if n <= 1 else NormalDist().inv_cdf((n - 0.375) / (n + 0.25))


def makespan_stretch(mean: float, variance: float, remaining: list[int]) -> float:
    """How much longer than at its mean pace a closed batch takes to finish, when every
    sequence gains `mean` tokens a step with `variance` and has `remaining` tokens to go
    (their upper bounds: max_tokens or the context; stops end sequences sooner):
    E[steps of the slowest sequence] / (max(remaining) / mean).

    A sequence's steps to finish R tokens are about normal, R / mean +- sqrt(R * variance /
    mean^3) (renewal theory). The slowest is one of those whose mean steps lie within two
    standard deviations of the longest; the expected maximum of n such adds
    expected_max_of_normals(n) standard deviations. Against a simulation of 32 sequences of
    128 tokens at acceptance 0.5-0.9 and k = 1-4 it is within 2 % (tests/test_adaptive.py)."""
    left = np.asarray(remaining, dtype=np.float64)  # [S]
    if left.size == 0 or variance <= 0.0 or mean <= 0.0:
        return 1.0
    spread = np.sqrt(left * variance / mean ** 3)  # [S]: std of each one's steps to finish
    longest = float(left.max()) / mean  # steps at the mean pace
    tied = int((left / mean + 2.0 * spread >= longest).sum())
    # + half a step: the last step overshoots (a plain step never does)
    extra = expected_max_of_normals(tied) * float(spread.max()) + 0.5
    return 1.0 + extra / longest


def batch_bucket(batch_size: int) -> int:
    """Batch sizes 1, 2, 3-4, 5-8, 9-16, ... share measurements."""
    return max(batch_size - 1, 0).bit_length()


@dataclass
class LearningBackoff:
    """Whether a new closed batch spends a step learning its own acceptance (CapCosts.choose's
    learn: one cap-1 step in which the draft prefills the prompts of the sequences that propose,
    LEARNING_SEQUENCES of them since session 43) when the engine's past says plain decoding.

    Why a backoff: on a steady workload whose acceptance does not pay, every batch paid for
    learning what the last one had learned. At batch 32 on the H200 at acceptance 0.5 the
    learning step (the draft's prefill of 4111 prompt tokens, 24.5 ms against a 5.6 ms plain
    step) and the caps tried after it cost 2.4-3.4 % of each batch, most of the 4-6 % lost there
    (0.94-0.96x). So each learning after which the batch settled on plain decoding doubles the
    number of new closed batches that decode plainly throughout, without learning and without
    speculating on the engine-wide acceptance (1, 3, then at most MAX_UNLEARNED_BATCHES), and a
    batch that settles speculating resets it: a shift to text that accepts well is found within
    MAX_UNLEARNED_BATCHES + 1 batches, and a batch allowed to learn whose engine-wide acceptance
    already says speculate needs no learning step at all. A batch is known by its
    sequences (ids are never reused), so every young step of it gets the same answer."""

    fruitless: int = 0  # learnings in a row after which the batch settled on plain decoding
    skip_left: int = 0  # new closed batches still to start without learning
    batch: set[int] = field(default_factory=set)  # the sequences of the last new closed batch
    learning: bool = False  # ... which learns
    pending: bool = False  # ... and has not settled yet
    pooled: bool = False  # ... and its sequences were given the batch's learned rate
    learners: set[int] = field(default_factory=set)  # ... and the sequences its step verified

    def learns(self, seq_ids: list[int]) -> bool:
        """Whether the young closed batch of these (unverified) sequences may learn."""
        if self.batch.isdisjoint(seq_ids):  # a new batch
            self.batch = set(seq_ids)
            self.learning = self.skip_left == 0
            self.skip_left = max(self.skip_left - 1, 0)
            self.pending = self.learning
            self.pooled = False
            self.learners = set()
        return self.learning

    def settled(self, cap: int, generated: float) -> None:
        """A closed batch past its start chose `cap` (0: plain decoding) on its own evidence,
        its sequences having generated `generated` tokens on average. A batch counts as
        fruitful only once it is still speculating at FRUITFUL_TOKENS, and one that
        speculated (learning or not) and then decodes plainly before that counts as
        fruitless: at acceptance 0.5 on the H200 at batch 32 most learning batches
        speculated for 4-23 steps after learning and then decoded plainly (0.94-0.98x plain
        decoding), and each reset the backoff, so 8 of 9 batches paid for learning (session
        22); a batch that speculated a few steps without learning reset it the same way
        (session 34)."""
        if cap > 0:
            if generated >= FRUITFUL_TOKENS:  # still speculating this far in: its text pays
                self.fruitless = self.skip_left = 0
                self.pending = False
            else:
                self.pending = True  # judged when it stops or reaches FRUITFUL_TOKENS
        elif self.pending:
            self.fruitless += 1
            self.skip_left = min(2 ** self.fruitless - 1, MAX_UNLEARNED_BATCHES)
            self.pending = False


@dataclass
class CapCosts:
    # (batch bucket, cap) -> [(step, step time / plain step time)]
    samples: dict[tuple[int, int], list[tuple[int, float]]] = field(default_factory=dict)
    current: dict[int, int] = field(default_factory=dict)  # batch bucket -> cap last chosen
    # [(step, seconds per token)] of the draft's catch-up forwards (its prefill, or catching up
    # on steps it sat out): what turning speculation on costs, per token it has to feed
    catch_up: list[tuple[int, float]] = field(default_factory=list)
    learning_step: bool = False  # whether choose's last cap was a learning step's

    def observe_catch_up(self, step: int, tokens: int, extra_seconds: float) -> None:
        """A decode step whose draft caught up on `tokens` tokens took extra_seconds more than
        the same step without the catch-up would have."""
        if tokens > 0 and extra_seconds > 0.0:
            self.catch_up.append((step, extra_seconds / tokens))
            del self.catch_up[:-CAP_SAMPLES]

    def catch_up_seconds(self, step: int) -> float | None:
        """Seconds per catch-up token: the fastest live sample (None if none)."""
        self.catch_up[:] = [s for s in self.catch_up if s[0] >= step - CAP_EXPIRY]
        return min((v for _, v in self.catch_up), default=None)

    def observe(self, step: int, batch_size: int, cap: int, seconds: float,
                plain_seconds: float) -> None:
        """One pure decode/verify step that ran `cap` over batch_size sequences."""
        kept = self.samples.setdefault((batch_bucket(batch_size), cap), [])
        kept.append((step, seconds / plain_seconds))
        del kept[:-CAP_SAMPLES]

    def _live(self, step: int, bucket: int, cap: int) -> list[tuple[int, float]]:
        kept = self.samples.get((bucket, cap), [])
        kept[:] = [s for s in kept if s[0] >= step - CAP_EXPIRY]
        return kept

    def _measured(self, step: int, batch_size: int, cap: int) -> list[tuple[int, float]]:
        """The live samples of this cap in batch_size's bucket, or if it has none, in the
        nearest larger bucket that has some (borrowed: see the module docstring; on a GPU a
        step over fewer sequences costs relatively less, so there a larger batch's ratio errs
        high, and anywhere a batch size is measured itself after BORROW_STEPS steps)."""
        bucket = batch_bucket(batch_size)
        for b in range(bucket, bucket + MAX_BORROW_BUCKETS + 1):
            kept = self._live(step, b, cap)
            if kept:
                return kept
        return []

    def ever_measured(self, batch_size: int) -> bool:
        """Some cap was measured in this batch size's bucket or one it may borrow from, live
        or expired (expiry empties a sample list but keeps its key)."""
        bucket = batch_bucket(batch_size)
        return any(bucket <= b <= bucket + MAX_BORROW_BUCKETS for b, _ in self.samples)

    def can_borrow(self, step: int, batch_size: int, max_k: int) -> bool:
        """Some cap has measurements for this batch size's bucket or a larger one."""
        return any(self._measured(step, batch_size, c) for c in range(1, max_k + 1))

    def ratio(self, step: int, batch_size: int, cap: int) -> float | None:
        """What a step with this cap costs, in plain steps: the lower quartile of its
        measured steps (None if untried). Not the fastest, as plain steps are priced: a
        draft's step varies with what was accepted before it (one or two tokens to feed each
        sequence, how many proposals), not only with load, and at batch 32 on the H200 the
        fastest of cap 1's steps said 1.30 plain steps where they typically cost 1.35-1.40,
        which at acceptance 0.5 decided that speculation paid when it did not. Not the
        median either: with two or three samples one slow step (a small catch-up that still
        counts as a measured step) priced a cap at 4 plain steps and a batch at acceptance
        0.7 stopped speculating for good."""
        if cap == 0:
            return 1.0
        kept = sorted(r for _, r in self._measured(step, batch_size, cap))
        return kept[len(kept) // 4] if kept else None

    def choose(self, step: int, batch_size: int, expected: list[float],
               explore_from_plain: bool = True, learn: bool = False) -> int:
        """The cap to run this step, given the tokens per sequence each cap is expected to emit
        (expected[0] = 1: plain decoding): a neighbour of the best measured cap while it has
        fewer than TRIES_PER_CAP measurements (one step can be a stalled one), else the best
        (plain decoding unless a cap beats it by MIN_SPEEDUP). explore_from_plain=False: when
        plain decoding is best, no cap is tried (see AdaptiveSpeculation._cap: a closed batch
        past its start). Costs are measured, tokens come
        from the sequences' current acceptance, so a change of text re-ranks every cap at
        once, not only the one being run. Turning speculation on or off must also win by
        SWITCH_MARGIN: each time it is turned back on the draft catches up on the tokens it
        skipped, a step that cost 3-5 plain ones at batch 32 on the H200, and near break-even
        the estimates' noise flipped it every few steps.

        learn: the batch has not verified any proposal of its own yet (a new closed batch),
        so when plain decoding is best on the engine's past acceptance it still runs cap 1
        once, to learn its own. Without it, an engine whose caps were measured on text that
        accepted 0.5 never tried one on a batch that accepted 0.7 (H200, batch 32: 0.98x,
        where speculating gained 1.11x)."""
        max_k = len(expected) - 1
        bucket = batch_bucket(batch_size)
        current = self.current.get(bucket, 0)
        speedups = {c: expected[c] / r for c in range(max_k + 1)
                    if (r := self.ratio(step, batch_size, c)) is not None}

        def score(c: int) -> float:
            s = speedups[c] / (1.0 if c == 0 else MIN_SPEEDUP)
            return s / SWITCH_MARGIN if (c > 0) != (current > 0) else s

        best = max(speedups, key=score)
        self.learning_step = False
        if best == 0 and learn and current == 0:
            # The cheapest step that verifies first proposals (of LEARNING_SEQUENCES sequences:
            # AdaptiveSpeculation._cap). A measurement, not a switch: speculation stays off
            # (current), so turning it on after this step must still win by SWITCH_MARGIN. (When the learning step counted as on, a batch
            # at break-even stayed on: at acceptance 0.5 on the H200, batch 32, cap 1 priced
            # at 0.99-1.0x kept running, caps 2-4 were explored, and those batches ran
            # 0.82-0.96x plain decoding.)
            self.learning_step = True
            return 1
        choice = (self._explore(step, batch_size, best, expected)
                  if best or explore_from_plain else 0)
        self.current[bucket] = choice
        return choice

    def _explore(self, step: int, batch_size: int, best: int, expected: list[float]) -> int:
        """An under-measured neighbour of the best cap (or the largest cap, while plain
        decoding is best and it could pay: _could_pay), else the best."""
        max_k = len(expected) - 1
        for c in (best + 1, best - 1):
            if 1 <= c <= max_k and len(self._measured(step, batch_size, c)) < TRIES_PER_CAP:
                return c
        if (best == 0 and len(self._measured(step, batch_size, max_k)) < TRIES_PER_CAP
                and self._could_pay(step, batch_size, max_k, expected[max_k])):
            return max_k
        return best

    def _could_pay(self, step: int, batch_size: int, cap: int, expected: float) -> bool:
        """Whether an under-measured cap could beat plain decoding, its cost extrapolated
        linearly from the two largest measured caps below it (a draft's step costs a fixed
        part plus a part per proposal); True when fewer than two are measured. The largest
        cap is tried while plain decoding is best for a draft that only pays with several
        proposals; where the measured caps' costs already rule it out, trying it only made
        the draft catch up on every sequence and ran steps at twice the plain cost (batch 32
        on the H200 at acceptance 0.5: caps 1 and 2 at 1.37 and 1.6 plain steps, cap 4 at
        2.0, for 1.94 tokens)."""
        measured = [(c, r) for c in range(cap - 1, 0, -1)
                    if (r := self.ratio(step, batch_size, c)) is not None][:2]
        if len(measured) < 2:
            return True
        (c1, r1), (c0, r0) = measured
        cost = r1 + (cap - c1) * max(r1 - r0, 0.0) / (c1 - c0)
        return expected / cost >= MIN_SPEEDUP
