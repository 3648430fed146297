"""Adaptive speculation: how many tokens each sequence proposes, every step.

The policy only chooses k (0 .. the hard limit) per sequence; verification decides the tokens,
so whatever it chooses the output is that of plain decoding (greedy) or has its distribution
(sampled). A step pays when its expected tokens per second beat plain decoding's:

* **What a proposal brings.** Each sequence keeps exponential moving averages of how often its
  first proposal is accepted (``f``) and how often a proposal is accepted after an accepted one
  (``c``: acceptance comes in runs, e.g. while the answer copies the prompt); its j-th proposal
  is accepted (with all earlier ones) with probability about ``f * c**(j-1)``, which is also
  the expected number of tokens it adds. Draft-free
  proposals (n-gram, suffix) are point masses, so a proposal the policy declined is still
  scored for free against the tokens the sequence goes on to commit ("shadow" verification:
  P(sampled token == x) = p(x) is exactly the acceptance probability of a point-mass proposal);
  the averages keep tracking the text without any verification cost and no probes are needed.
  New sequences start from the engine-wide averages. Draft-free proposals also say how much
  context their lookup matched, and an unpinned sequence's proposal is valued by the recent
  acceptance of proposals with that match length, engine-wide, its own averages as the prior
  (evidence.py: after a 1-token match a first proposal was accepted 20 % of the time, after
  a 4-token one 87 %, which no sequence average separates).
* **What it costs, measured on this machine.** ``StepCosts`` learns the wall time of a
  whole engine step (target pass, a draft model's passes, and the host work per sequence and per
  emitted token, which dominates on a GPU at large batches) as a function of the batch size B
  and the number of proposals p in it: the plain
  decode time per B, the fastest of its recent samples (other load only ever slows a step
  down), and for speculative steps the ratio t(B, p) / t(B, 0) per (B, p) bucket, the lower
  median of its recent samples, each taken against the median plain step (StepCosts.observe),
  and a count measured once measured again after CONFIRM_STEPS (ratio_curve). Before a
  bucket's first speculative steps, a proposal costs what a sequence adds to a plain step
  (StepCosts.proposal_prior). A step where many sequences decode for
  the first time teaches nothing (driver._decodes_only: one-time costs per sequence). It also
  measures the extra cost of a plain step right after a speculative one (a CPU backend may
  rebuild decode state then) and charges speculative steps with it, in proportion to how often
  speculation is switched off again. Nothing is assumed about the hardware: on a GPU at small
  batch extra query tokens are nearly free and the ratios say so; on a CPU a pass over k+1
  tokens costs 1.5-2x a decode from k = 3 and they say that; at large batches every token
  costs and speculation backs off. Unmeasured (B, p) are interpolated between measured ones;
  past the largest measured p the slope of the last measured segment continues, a lower bound
  since the cost is convex in p (optimism: a larger p is tried once whenever it could pay,
  and then it is measured). That optimism is bounded: a step tries at most
  ``EXPLORE_FACTOR`` times the largest measured p (at least ``EXPLORE_MIN``), so a large
  batch finds its cost curve in a few doubling steps instead of betting one step on every
  candidate (on a CPU at batch 32, 75 proposals cost 2.7 plain steps). Samples expire, so
  the estimates follow the machine's load.
* **Draft models** (plan-first proposers, whose declined proposals cannot be scored for free and
  whose cost is mostly a fixed price per step) do not choose proposal by proposal: the batch
  runs a cap on k chosen by measured speedup (batch_cap.py), and each sequence proposes
  min(cap, its own k), at least one.

For draft-free methods, each step the candidate proposals are sorted by that gain (most likely
accepted first) and the policy keeps the prefix with the highest predicted tokens/second, none
if plain decoding is predicted faster. ``speculative_disable_by_batch_size`` still applies
first, as a hard limit.

Sampled requests are *pinned*: with rejection sampling the token at a position depends on
whether it was a proposal or a bonus position, so a sampled request's output is reproducible
(and a seeded one independent of its batch mates) only if its k never depends on measured
timings or on other requests. A pinned sequence proposes j tokens while the gain of the j-th
stays above ``PINNED_MIN_GAIN``, from its own history and a fixed prior.
"""

from __future__ import annotations

import math
import statistics
from collections import deque
from dataclasses import dataclass, field
from itertools import accumulate

import numpy as np

from specserve.spec_decode.batch_cap import (
    LEARNING_SEQUENCES,
    CapCosts,
    LearningBackoff,
    batch_bucket,
    makespan_stretch,
)
from specserve.spec_decode.evidence import EvidenceAcceptance

EMA_WEIGHT = 0.3  # weight of the newest verification in a sequence's acceptance average
PRIOR_ACCEPTANCE = 0.5  # pinned sequences, and the engine-wide average before any data
GLOBAL_EMA_WEIGHT = 0.05  # the engine-wide acceptance average that new sequences start from
PINNED_MIN_GAIN = 0.3  # a pinned sequence proposes j tokens while their gain stays above this
PROBE_INTERVAL = 16  # a pinned sequence of a draft model: idle steps before a one-token probe
MAX_PROBE_INTERVAL = 256  # ... after probes that did not lead to speculation
SEQ_MIN_GAIN = 0.1  # under a draft model's cap, a sequence proposes j tokens while gain >= this
MIN_CONTINUATION_TRIALS = 4  # before a sequence's own continuation rate is trusted
BORROW_STEPS = 8  # steps a draft model's batch runs on larger batches' cap measurements
CLOSED_EXPLORE_TOKENS = 8  # a closed batch tries caps from plain decoding only this young
MIN_GAIN = 1.02  # speculate only when predicted >= 2 % faster than plain decoding
SAMPLES_KEPT = 6  # per cost bucket (plain: the fastest counts; ratios: the lower median)
STALE_PLAIN = 0.97  # a speculative step this much faster than "plain" shows plain is stale
PLAIN_EXPIRY = 100  # steps after which a plain-decode sample is dropped
RATIO_EXPIRY = 200  # ... a speculative-step cost ratio sample
CONFIRM_STEPS = 16  # a cost ratio resting on one sample is trusted this long (ratio_curve)
EXPLORE_MIN = 8  # draft-free proposals a step may try before any cost of its batch is known
EXPLORE_FACTOR = 2  # ... and at most this many times the largest measured count after that
MONOTONE_COSTS = True  # a count's cost ratio is at most that of any larger count (ratio_curve)
TYPICAL_REFERENCE = True  # ratio samples are taken against the median plain step (observe)
MEDIAN_RATIOS = True  # a count's cost is the lower median of its ratio samples (ratio_curve)
PLAIN_ROW_PRIOR = True  # unmeasured proposals cost a plain step's row (proposal_prior)
PRIOR_MIN_SPREAD = 4  # batch sizes at least this far apart give the proposal_prior slope


@dataclass
class _Samples:
    values: deque = field(default_factory=lambda: deque(maxlen=SAMPLES_KEPT))  # (step, value)

    def add(self, step: int, value: float) -> None:
        self.values.append((step, value))

    def live(self, step: int, expiry: int) -> list:
        """The values not yet expired, oldest first."""
        while self.values and self.values[0][0] < step - expiry:
            self.values.popleft()
        return [v for _, v in self.values]

    def drop_above(self, limit: float) -> None:
        kept = [(step, v) for step, v in self.values if v <= limit]
        self.values.clear()
        self.values.extend(kept)

    def confirmed(self, step: int, expiry: int, confirm: int) -> list:
        """live(), except that a lone sample older than `confirm` steps counts for nothing
        (see StepCosts.ratio_curve)."""
        values = self.live(step, expiry)
        if len(values) == 1 and self.values[0][0] < step - confirm:
            return []
        return values

    def low(self, step: int, expiry: int) -> float | None:
        """The smallest unexpired value: other load on the machine only ever slows a step
        down, so the fastest recent time is the best estimate of what the step itself costs."""
        values = self.live(step, expiry)
        return min(values) if values else None


@dataclass
class StepCosts:
    """Measured engine-step times: plain decode per batch size, other steps as ratios to it."""

    step: int = 0  # steps planned so far (the clock samples expire on)
    plain: dict[int, _Samples] = field(default_factory=dict)  # B -> seconds
    ratio: dict[tuple[int, int], _Samples] = field(default_factory=dict)  # (bucket, p) -> t/t0
    after: dict[int, _Samples] = field(default_factory=dict)  # bucket -> plain-after-spec / t0
    # B -> the fastest plain step ever measured there (never expires: proposal_prior's fallback)
    plain_floor: dict[int, float] = field(default_factory=dict)
    switch_rate: float = 1.0  # how often a speculative step is followed by a plain one

    # ---- observations ----------------------------------------------------------------------
    def observe(self, batch_size: int, num_proposals: int, seconds: float,
                after_spec: bool) -> None:
        """One pure decode/verify pass over batch_size sequences with num_proposals in total."""
        b = batch_bucket(batch_size)
        if num_proposals == 0 and not after_spec:
            self.plain.setdefault(batch_size, _Samples()).add(self.step, seconds)
            self.plain_floor[batch_size] = min(self.plain_floor.get(batch_size, seconds),
                                               seconds)
            return
        t0 = self.plain_time(batch_size)
        if t0 is None:
            return
        if num_proposals > 0 and seconds < STALE_PLAIN * t0:
            self._drop_plain_above(batch_size, seconds)
            return
        # One step's time against a typical plain step's, not the fastest of up to
        # SAMPLES_KEPT: a ratio sample is one draw of the machine's noise, and over the fastest
        # plain step it reads high by that noise's spread. (The cost of a count was then the
        # fastest of its own few samples, against the fastest of many plain ones: on the
        # shared CI machine, while loaded (plain steps 7.1-13.9 ms, gguf_a8 SmolLM2), two
        # rows read 1.10-1.18 plain steps against 1.03 measured alone. An estimate that errs
        # high is never corrected, as the policy does not try what it believes dear; one that
        # errs low is tried, and measured. On a quiet machine the two references gave the
        # same speed within noise.) See ratio_curve for how a count's samples combine.
        ref = self._typical_plain(batch_size, t0) if TYPICAL_REFERENCE else t0
        if num_proposals == 0:
            self.after.setdefault(b, _Samples()).add(self.step, seconds / ref)
        else:
            key = (b, proposal_bucket(num_proposals))
            self.ratio.setdefault(key, _Samples()).add(self.step, (num_proposals, seconds / ref))

    def _typical_plain(self, batch_size: int, fastest: float) -> float:
        """The median of the live plain samples at this batch size (fastest: plain_time's
        estimate, used where none is measured at exactly this size)."""
        samples = self.plain.get(batch_size)
        values = samples.live(self.step, PLAIN_EXPIRY) if samples is not None else []
        return statistics.median(values) if values else fastest

    def _drop_plain_above(self, batch_size: int, seconds: float) -> None:
        """A step with proposals ran faster than the plain step it is priced against: that
        plain time is stale (typically one slow sample: the first decode step after a prefill
        or a batch change, when a CPU backend rebuilds its decode state, can cost several
        steady ones). Were it kept, every speculative step would look cheaper than plain
        decoding and speculation would run unchecked until the sample expired. Plain samples
        at batch sizes up to this one that are slower than this step are dropped, so the next
        step decodes plainly and measures the plain time again."""
        for b, samples in self.plain.items():
            if b <= batch_size:
                samples.drop_above(seconds)

    def observe_switch(self, switched_off: bool) -> None:
        self.switch_rate = 0.9 * self.switch_rate + 0.1 * float(switched_off)

    # ---- estimates -------------------------------------------------------------------------
    def plain_time(self, batch_size: int) -> float | None:
        """Seconds of a plain decode pass: measured at this batch size, else interpolated
        between measured neighbours no more than 1.5x away."""
        known = {b: t for b, s in self.plain.items()
                 if (t := s.low(self.step, PLAIN_EXPIRY)) is not None}
        if batch_size in known:
            return known[batch_size]
        below = max((b for b in known if b < batch_size), default=None)
        above = min((b for b in known if b > batch_size), default=None)
        if below is not None and above is not None and above <= 1.5 * below:
            w = (batch_size - below) / (above - below)
            return known[below] + w * (known[above] - known[below])
        near = [b for b in (below, above) if b is not None
                and max(b, batch_size) <= 1.5 * min(b, batch_size)]
        if not near:
            return None
        b = min(near, key=lambda x: abs(x - batch_size))
        # Err low (a lower t0 makes speculative steps look dearer): t grows sublinearly in B.
        return known[b] * batch_size / b if b > batch_size else known[b]

    def proposal_prior(self, batch_size: int) -> float:
        """What one proposal costs, in plain steps, before a batch's cost curve shows it: what
        one more sequence adds to a plain step here, from the plain steps measured at batch
        sizes within 1.5x of this one (the slope between the smallest and the largest of
        them), over this batch size's plain step, and at least the chord from a smaller
        batch size measured at any time (plain_floor: the nearest at or below half this size,
        else the smallest). A step's cost is convex in B (flat while reading the weights
        dominates, then rising), so that chord errs low and larger counts are still tried
        and measured; the local slope is steeper unless noise made it so (two sizes a few
        apart, each a few noisy samples: it read 0 at batch 27 on the Zen 3). 0 with neither.

        Why: an unmeasured count was taken to cost what plain decoding does, and every batch
        bucket a shrinking closed batch entered bet up to EXPLORE_MIN proposals on it. On the
        2-core CPU at batch 16-32, where each row costs ~2 ms of a 40-80 ms step, those steps
        cost 1.3-2.5 plain steps, and chat text at batch 32 ran 2-3 % slower than plain
        decoding (session 41). A verified row costs at most what a new sequence's row does
        (it reads no other context), so this errs high only where extra query rows are
        cheaper than whole sequences; on a GPU at small batches both are nearly free and the
        prior says so. The fallback: a closed batch of 32 runs at one size until its end, so
        nothing near 32 was measured at its start and its proposals were priced at nothing;
        on the Zen 3 CPU its first steps bet 8, then 16 proposals on chat text (measured 1.2
        and 1.5 plain steps) and explored again at each batch size of its tail, ~1 % of the
        run (session 44)."""
        t0 = self.plain_time(batch_size)
        if t0 is None:
            return 0.0
        known = {b: t for b, s in self.plain.items()
                 if max(b, batch_size) <= 1.5 * min(b, batch_size)
                 and (t := s.low(self.step, PLAIN_EXPIRY)) is not None}
        local = 0.0
        if len(known) >= 2 and max(known) - min(known) >= PRIOR_MIN_SPREAD:
            lo, hi = min(known), max(known)
            local = max(known[hi] - known[lo], 0.0) / (hi - lo) / t0
        smaller = [b for b in self.plain_floor if b <= batch_size - PRIOR_MIN_SPREAD]
        if not smaller:
            return local
        halves = [b for b in smaller if 2 * b <= batch_size]
        lo = max(halves) if halves else min(smaller)
        chord = max(t0 - self.plain_floor[lo], 0.0) / (batch_size - lo) / t0
        return max(local, chord)

    def ratio_curve(self, batch_size: int) -> list[tuple[float, float]]:
        """Measured (p, t(B, p) / t(B, 0)) points of B's bucket, (0, 1) first."""
        b = batch_bucket(batch_size)
        points = [(0.0, 1.0)]
        for (bucket, _), samples in sorted(self.ratio.items()):
            # A count measured only once is believed for CONFIRM_STEPS steps, then measured
            # again if it could pay. Why: the estimate is the fastest recent sample, and a
            # count the policy believes dear is not tried again, so one slow sample (the
            # engine's first verification, 28.7 ms against 7.5 steady for 6 rows of gguf_a8
            # SmolLM2 at batch 1: first-use costs, right after a prefill) kept "[ngram]"
            # from speculating for 200 steps, two whole requests of the benchmark. A second
            # sample confirms a count that is really dear (the lower of two is robust).
            # The cost is the lower median of the samples (the lower of two, the median of
            # three): each is one step against the typical plain step, so its noise goes both
            # ways, and their fastest erred low. On the 2-core CPU at batch 30 the fastest of
            # six said 0.98-1.00 plain steps for 8 proposals that cost 1.12-1.23 (session
            # 41), and the policy kept betting on them: chat text at batch 32 lost 1-2 %.
            values = (samples.confirmed(self.step, RATIO_EXPIRY, CONFIRM_STEPS)
                      if bucket == b else None)
            if values:
                ratios = sorted(r for _, r in values)
                points.append((statistics.median(p for p, _ in values),
                               ratios[(len(ratios) - 1) // 2] if MEDIAN_RATIOS else ratios[0]))
        if MONOTONE_COSTS:
            # A step never costs more for verifying fewer proposals: a count measured dearer
            # than a larger one holds a slow sample (a count tried once or twice, in a slow
            # moment), and as the policy avoids counts it believes dear it would not measure
            # it again before the sample expires. Each point takes the cheapest ratio at its
            # count or above.
            for i in range(len(points) - 2, 0, -1):
                if points[i][1] > points[i + 1][1]:
                    points[i] = (points[i][0], points[i + 1][1])
        return points

    def switch_penalty(self, batch_size: int) -> float:
        """Expected extra cost (in plain steps) that one speculative step causes afterwards."""
        r = self._bucket_low(self.after, batch_size)
        return 0.0 if r is None else max(r - 1.0, 0.0) * self.switch_rate

    def _bucket_low(self, table: dict[int, _Samples], batch_size: int) -> float | None:
        """The fastest live ratio of batch_size's bucket in a per-bucket table."""
        samples = table.get(batch_bucket(batch_size))
        return None if samples is None else samples.low(self.step, RATIO_EXPIRY)


def proposal_bucket(p: int) -> int:
    """Cost ratios are kept per proposal count up to 8, then per ~25 % wide bucket."""
    if p <= 8:
        return p
    return 8 + round(4 * math.log2(p / 8))


def explore_limit(points: list[tuple[float, float]]) -> int:
    """The most proposals a step may try, given its batch's measured cost curve (ratio_curve):
    a bounded step past the largest proposal count whose cost is measured."""
    return max(EXPLORE_MIN, int(EXPLORE_FACTOR * points[-1][0]))


def row_value(points: list[tuple[float, float]], batch_size: int) -> float:
    """What one row of a decode step costs as a share of a plain step's cost per token, from
    the measured cost per proposal of a cost curve (0 until one is measured, at most 1)."""
    p, ratio = points[-1]
    return 0.0 if p == 0 else min(1.0, max(0.0, (ratio - 1.0) / p * batch_size))


def _cost_table(points: list[tuple[float, float]], max_p: int,
                penalty: float, prior: float = 0.0) -> list[float]:
    """cost[p] for p = 0..max_p: a step with p proposals, in plain steps (t(B, p) / t(B, 0)
    from measured points, linear in between, plus the switch penalty; cost[0] = 1).

    Past the largest measured p it follows the slope between the two largest measured counts
    (never downwards; with fewer than two, `prior` per proposal: StepCosts.proposal_prior, the
    cost of a plain step's row): a lower bound, as a step's cost is convex in p
    (extra rows are nearly free while a pass is bound by reading the weights, and cost their
    full compute once it is not), so a larger p is tried whenever it could pay and is measured
    by trying it. Flat (the last ratio) was too optimistic where rows cost linearly: on the CPU
    at batch 32, with 64 proposals measured at 2.6 plain steps, steps bet 100-105 proposals on
    chat text as if they cost as much, and they cost 3.8-4.0 (50-76 ms lost each time, ~1 % of
    a run). One pass over p in plain Python (the planner reads every p up to the batch's
    candidates each step: a search per p cost ~0.25 ms per step at batch 32, and numpy's
    per-call overhead on arrays this small ~0.1 ms per step at batch 1, 1 % of a CPU step);
    the same arithmetic as np.interp."""
    xs = [x for x, _ in points]
    ys = [y for _, y in points]
    last = len(xs) - 1
    table = [1.0]
    i = 0
    # slope of the last segment between two measured counts ((0, 1) -> the first one also
    # holds a speculative step's fixed cost, which is not paid again per proposal)
    beyond = prior if last < 2 else max(
        (ys[last] - ys[last - 1]) / (xs[last] - xs[last - 1]), 0.0)
    for p in range(1, max_p + 1):
        if p >= xs[last]:
            value = ys[last] + beyond * (p - xs[last])
        elif p <= xs[0]:
            value = ys[0]
        else:
            while xs[i + 1] < p:  # xs[i] < p <= xs[i + 1]
                i += 1
            slope = (ys[i + 1] - ys[i]) / (xs[i + 1] - xs[i])
            value = slope * (p - xs[i]) + ys[i]
        table.append(value + penalty)
    return table


@dataclass
class AdaptiveSpeculation:
    max_k: int
    costs: StepCosts = field(default_factory=StepCosts)
    # seq_id -> [first, cont]: EMAs of P(proposal 1 accepted) and of P(proposal j accepted |
    # proposal j-1 accepted). Two numbers, because acceptance comes in runs: a sequence that
    # copies its input accepts long runs, and one miss says little about the next run.
    acceptance: dict[int, list[float]] = field(default_factory=dict)
    global_acceptance: list[float] = field(
        default_factory=lambda: [PRIOR_ACCEPTANCE, PRIOR_ACCEPTANCE])
    idle_steps: dict[int, int] = field(default_factory=dict)  # seq_id -> steps without proposing
    # seq_id -> idle steps before the next probe: doubles with every probe (up to
    # MAX_PROBE_INTERVAL), back to PROBE_INTERVAL once the sequence speculates on its merits
    probe_interval: dict[int, int] = field(default_factory=dict)
    continuation_trials: dict[int, int] = field(default_factory=dict)  # seq_id -> count
    # seq_id -> whether its first verified proposal was accepted (pooled by _pool_learned)
    first_outcome: dict[int, float] = field(default_factory=dict)
    caps: CapCosts = field(default_factory=CapCosts)  # plan-first proposers
    learning: LearningBackoff = field(default_factory=LearningBackoff)  # ... new closed batches
    # draft-free proposers: acceptance by how much context a proposal matched (evidence.py)
    evidence: EvidenceAcceptance = field(default_factory=EvidenceAcceptance)
    # batch bucket -> steps in a row it ran on a larger bucket's cap measurements
    borrowed_steps: dict[int, int] = field(default_factory=dict)
    last_cap: int | None = None  # the cap the last plan(plan_first=True) ran
    # The last plan(plan_first=True) was a closed batch past its start choosing plain decoding
    # without trying a cap: it stays so while the batch only loses sequences (nothing makes
    # speculation more attractive then: no verification changes an acceptance, the stretch
    # grows as the remaining tokens shrink and the draft's lag grows), so the driver may skip
    # planning until a sequence joins.
    settled_plain: bool = False

    # ---- acceptance ------------------------------------------------------------------------
    def record(self, seq_id: int, num_proposed: int, num_accepted: int,
               match_length: int = 0) -> None:
        """Update a sequence's averages from one verified (or shadow) proposal run, and its
        evidence class's counts when the proposer said how much context it matched."""
        if num_proposed == 0:
            return
        self.evidence.record(match_length, num_proposed, num_accepted)
        est = self.acceptance.setdefault(seq_id, list(self.global_acceptance))
        first = float(num_accepted > 0)
        self.first_outcome.setdefault(seq_id, first)
        # Continuations tried: proposals 2.. whose predecessor was accepted.
        trials = min(num_accepted, num_proposed - 1)
        self.continuation_trials[seq_id] = self.continuation_trials.get(seq_id, 0) + trials
        for target in (est, self.global_acceptance):
            w = EMA_WEIGHT if target is est else GLOBAL_EMA_WEIGHT
            target[0] += w * (first - target[0])
            if trials > 0:
                target[1] += w * ((num_accepted - 1) / trials - target[1])

    def forget(self, seq_id: int) -> None:
        self.acceptance.pop(seq_id, None)
        self.idle_steps.pop(seq_id, None)
        self.probe_interval.pop(seq_id, None)
        self.continuation_trials.pop(seq_id, None)
        self.first_outcome.pop(seq_id, None)

    def _acceptance(self, seq_id: int, pinned: bool) -> list[float]:
        """A sequence's averages, started at its first plan: pinned ones from a fixed prior
        (their k must never depend on what other requests did), others from the engine-wide
        averages.

        Until a sequence has tried MIN_CONTINUATION_TRIALS continuations its continuation rate
        is taken as at least its first-proposal rate: c is only learned by proposing two or
        more tokens, and a pessimistic prior would keep it proposing one token forever (where
        one proposal does not pay for a draft pass, as at large batches, it would never
        speculate at all)."""
        prior = [PRIOR_ACCEPTANCE, PRIOR_ACCEPTANCE] if pinned else self.global_acceptance
        est = self.acceptance.setdefault(seq_id, list(prior))
        if self.continuation_trials.get(seq_id, 0) < MIN_CONTINUATION_TRIALS:
            return [est[0], max(est)]
        return est

    @staticmethod
    def gain(acceptance: list[float], j: int) -> float:
        """Expected tokens the j-th proposal adds: P(proposals 1..j all accepted)."""
        return acceptance[0] * acceptance[1] ** (j - 1)

    # ---- planning --------------------------------------------------------------------------
    def plan(self, seq_ids: list[int], limits: list[int], pinned: list[bool] | None = None,
             plan_first: bool = False, closed: bool = False,
             remaining: list[int] | None = None, generated: list[int] | None = None,
             lag: int = 0, match_lengths: list[int] | None = None) -> list[int]:
        """Proposals per decoding sequence (each <= its limit: the hard cap, or for draft-free
        methods the length of the proposal already found). plan_first=True: a draft model
        (the batch runs a measured cap, see batch_cap.py; last_cap says which). closed: no
        request waits for a slot (Scheduler.is_closed); then remaining: each sequence's
        tokens still to go at most (a draft model's caps are priced by when the slowest
        sequence finishes), generated: the tokens each has generated (a closed batch past its
        start does not try caps), and lag: the tokens the draft would catch up on before
        proposing (see _cap).
        match_lengths (draft-free proposers): how much context each proposal matched; an
        unpinned sequence's gains then come from its evidence class (evidence.py)."""
        self.costs.step += 1
        self.settled_plain = False
        n = len(seq_ids)
        pinned = pinned or [False] * n
        ks = [0] * n
        if plan_first and closed:
            self._pool_learned(seq_ids, pinned)
        accept = [self._acceptance(s, p) for s, p in zip(seq_ids, pinned, strict=True)]
        candidates = []  # (gain of the j-th proposal of sequence i, j, i)
        for i in range(n):
            limit = min(limits[i], self.max_k)
            if pinned[i]:
                ks[i] = max((j for j in range(1, limit + 1)
                             if self.gain(accept[i], j) >= PINNED_MIN_GAIN), default=0)
            elif match_lengths is not None and limit > 0:
                gains = self.evidence.gains(match_lengths[i], accept[i], limit)
                candidates.extend((gain, j, i) for j, gain in enumerate(gains, 1))
            elif not plan_first:
                candidates.extend((self.gain(accept[i], j), j, i) for j in range(1, limit + 1))
        if candidates:
            self._choose(n, ks, accept, candidates, closed)
        if plan_first:
            self._cap(seq_ids, ks, limits, accept, pinned, remaining if closed else None,
                      generated if closed else None, lag)
            self._probe_pinned(seq_ids, limits, ks, pinned)
        return ks

    def _pool_learned(self, seq_ids: list[int], pinned: list[bool]) -> None:
        """After a closed batch's learning step (batch_cap.LearningBackoff): every unpinned
        sequence's first-proposal rate becomes the mean first outcome of the sequences that
        step verified (its learners, LEARNING_SEQUENCES of them). Why: one verification moves
        a sequence's average only EMA_WEIGHT of the way from the engine-wide prior (the
        previous batches' text), so a batch learned ~30 % of its own acceptance: on the H200
        at batch 32, text at 0.7 after batches at 0.5 looked like 0.56 and decoded plainly.
        The learners' outcomes together measure the batch's rate (8 of them to about +-0.18);
        each sequence's own average then goes on from there."""
        learning = self.learning
        if not learning.pending or learning.pooled or learning.batch.isdisjoint(seq_ids):
            return
        ids = [s for s, p in zip(seq_ids, pinned, strict=True) if not p]
        outcomes = [self.first_outcome.get(s) for s in learning.learners if s in ids]
        if not outcomes or any(o is None for o in outcomes):
            return
        mean = sum(outcomes) / len(outcomes)
        for seq_id in ids:
            self.acceptance.setdefault(seq_id, list(self.global_acceptance))[0] = mean
        learning.pooled = True

    def _cap(self, seq_ids: list[int], ks: list[int], limits: list[int],
             accept: list[list[float]], pinned: list[bool], remaining: list[int] | None = None,
             generated: list[int] | None = None, lag: int = 0) -> None:
        """A draft model's batch cap (batch_cap.py): every unpinned sequence proposes
        min(cap, its own k), where its own k is the longest run of proposals whose gains stay
        above SEQ_MIN_GAIN (at least one, within its limit). Plain decoding until the plain
        step time is measured. remaining (a closed batch): tokens each sequence has left;
        each cap's expected tokens are divided by the closed batch's makespan stretch under
        it (batch_cap.py). Vectorized over the batch: this runs every step, and at batch 32
        a loop per sequence and proposal cost ~1 ms of host time per step (the H200's whole
        step is ~6 ms).

        generated (a closed batch): once its sequences have generated CLOSED_EXPLORE_TOKENS on
        average, a closed batch whose best choice is plain decoding tries no cap (cap samples
        expire, and plain-is-best batches otherwise try the largest cap again then). Trying a
        cap makes the draft catch up on every token it skipped, over the whole batch: at batch
        32 on the H200, 6159 tokens, 42 ms or 7 plain steps, mid-run; a batch that nobody
        joins ends within its remaining tokens, and on its measurements of a moment ago it
        cannot win that back. At its start the catch-up is the prompts, and new text may
        accept differently, so a young batch still tries, and so does an engine that never
        measured a cap at this batch size (it has nothing to go on: a batch that shrank
        every step never got to try while young).

        lag (a closed batch that is not speculating): turning speculation on first makes the
        draft catch up on `lag` tokens, at the measured seconds per catch-up token; that
        one-time cost is spread over the steps the batch has left at each cap's pace and
        added to the cap's cost. At batch 32 on the H200 the draft's prefill of the prompts
        (4143 tokens, ~17 ms, ~3 plain steps) and the spread of the batch's end together
        ate the ~10 % a cap of 1 gains per step at acceptance 0.5."""
        n = len(seq_ids)
        unpinned = [i for i in range(n) if not pinned[i]]
        self.last_cap = None if not unpinned else 0
        if not unpinned:
            return
        bucket = batch_bucket(n)
        if self.costs.plain_time(n) is None:
            # Plain decoding at this batch size is not measured (or its samples expired during
            # a long speculative run), so no cap can be priced here. The batch runs on the
            # measurements of its bucket or larger ones for BORROW_STEPS steps (see
            # batch_cap.py), then decodes plainly until a plain step has measured it: the
            # first plain step after a speculative one only measures the switch
            # (StepCosts.observe), so stopping after one plain step left the time unmeasured
            # and repeated the cycle, one plain step in every nine on the H200 at batch 32.
            borrowed = self.borrowed_steps.get(bucket, 0)
            if borrowed >= BORROW_STEPS or not self.caps.can_borrow(self.costs.step, n,
                                                                    self.max_k):
                return
            self.borrowed_steps[bucket] = borrowed + 1
        else:
            self.borrowed_steps.pop(bucket, None)
        acc = np.array([accept[i] for i in unpinned])  # [U, 2]: first, continuation
        limit = np.minimum([limits[i] for i in unpinned], self.max_k)  # [U]
        j = np.arange(1, self.max_k + 1)  # [K]
        gains = acc[:, :1] * acc[:, 1:] ** (j - 1)  # [U, K]: P(proposals 1..j accepted)
        paying = ((gains >= SEQ_MIN_GAIN) & (j <= limit[:, None])).sum(axis=1)  # [U]
        own = np.where(paying >= 2, paying, np.minimum(limit, 1))  # [U]
        gains = np.where(j <= own[:, None], gains, 0.0)  # [U, K]
        tokens = np.cumsum(gains, axis=1)  # [U, K]: expected extra tokens under caps 1..K
        expected = np.concatenate([[1.0], 1.0 + tokens.mean(axis=0)])  # [K + 1]
        if remaining is not None:
            # E[X^2] = sum_j (2j - 1) g_j for the accepted count X
            square = np.cumsum((2 * j - 1) * gains, axis=1)  # [U, K]
            variance = np.concatenate([[0.0], (square - tokens ** 2).mean(axis=0)])  # [K + 1]
            left = [remaining[i] for i in unpinned]
            expected = expected / np.array([makespan_stretch(e, v, left)
                                            for e, v in zip(expected, variance, strict=True)])
        settled = generated is not None and self.caps.ever_measured(n) and (
            sum(generated) > CLOSED_EXPLORE_TOKENS * len(generated))
        # A closed batch none of whose sequences was verified yet knows nothing of its own
        # acceptance: the engine-wide average is the previous batches' text. (record() gives
        # a sequence its continuation_trials entry at its first verified run.)
        unverified = generated is not None and not settled and not any(
            seq_ids[i] in self.continuation_trials for i in unpinned)
        if unverified:
            # ... and nothing to stay on with: the last batch may have ended speculating, but
            # this one's draft prefills every prompt either way, so turning speculation on is
            # priced (catch-up, SWITCH_MARGIN) as from plain decoding. (Carried over, a batch
            # at acceptance 0.5 after one that ended on ran caps 1-2 for 17-30 steps at
            # 0.92-0.95x plain decoding, H200, batch 32.)
            self.caps.current[bucket] = 0
        if remaining is not None and lag and self.caps.current.get(bucket, 0) == 0:
            expected = self._charge_catch_up(n, expected, lag, max(remaining, default=0))
        # An unverified batch may skip learning (batch_cap.LearningBackoff): then it tries no
        # cap from plain decoding either, which would cost the same draft prefill
        learn = unverified and self.learning.learns([seq_ids[i] for i in unpinned])
        skipped = unverified and not learn
        # ... and it does not speculate on the engine-wide acceptance either: the backoff
        # says recent batches' own evidence did not pay, and the engine-wide average is
        # mostly the last verification step of the last batch (its EMA weighs 32 records a
        # step), a noisy read of the same text. (H100, batch 32, acceptance 0.5: a skipped
        # batch started at cap 2 on it, ran 5 steps at 0.95x plain decoding, and its
        # speculating past CLOSED_EXPLORE_TOKENS reset the backoff.)
        cap = self.last_cap = 0 if skipped else self.caps.choose(
            self.costs.step, n, expected.tolist(), explore_from_plain=not settled,
            learn=learn)
        if settled:
            self.learning.settled(cap, sum(generated) / len(generated))
        # A batch that skipped learning and decodes plainly is settled from its start: no
        # verification will change its acceptance, and it tries no cap (so the driver stops
        # planning for it: at batch 32 planning a young batch cost ~0.5 ms a step on the CPU)
        self.settled_plain = (settled or skipped) and cap == 0
        # A learning step verifies the first proposal of only LEARNING_SEQUENCES of the batch
        # (its first ones): the draft prefills just their prompts, and their mean outcome
        # stands for the batch (_pool_learned; 8 outcomes measure a rate to about +-0.18).
        # Learning on all 32 made the draft prefill every prompt, 24.5 ms against a 5.6 ms
        # plain step on the H200 at batch 32, and each learning batch ran 0.96-0.97x plain
        # decoding (session 42). If the batch then speculates, the draft catches up on the
        # others' prompts then, a cost the caps are priced with (lag).
        proposing = len(unpinned)
        if not skipped and self.caps.learning_step:
            proposing = min(LEARNING_SEQUENCES, proposing)
            self.learning.learners = {seq_ids[i] for i in unpinned[:proposing]}
        for i, k in zip(unpinned[:proposing], own.tolist()[:proposing], strict=True):
            ks[i] = min(cap, k)

    def _charge_catch_up(self, n: int, expected: np.ndarray, lag: int,
                         longest: int) -> np.ndarray:
        """expected tokens per cap, scaled so that each cap's speedup (expected / its cost
        ratio) pays for a catch-up of `lag` tokens spread over its remaining steps."""
        per_token = self.caps.catch_up_seconds(self.costs.step)
        plain = self.costs.plain_time(n)
        if per_token is None or plain is None or longest <= 0:
            return expected
        once = lag * per_token / plain  # the catch-up, in plain steps
        charged = expected.copy()
        for c in range(1, len(expected)):
            ratio = self.caps.ratio(self.costs.step, n, c)
            if ratio is not None:
                steps = longest / expected[c]  # steps left at this cap's pace
                charged[c] *= ratio / (ratio + once / steps)
        return charged

    def _expected(self, n: int, ks: list[int], accept: list[list[float]]) -> float:
        """Expected tokens a step emits when sequence i proposes ks[i] tokens."""
        return n + sum(sum(self.gain(a, j) for j in range(1, k + 1))
                       for a, k in zip(accept, ks, strict=True))

    @staticmethod
    def _rate_to_beat(expected: float, cost: list[float], fixed: int) -> float:
        """Predicted tokens per plain step of the step as planned so far (fixed proposals);
        adding speculation to a plain step must beat it by MIN_GAIN."""
        return expected / cost[fixed] * (MIN_GAIN if fixed == 0 else 1.0)

    def _choose(self, n: int, ks: list[int], accept: list[list[float]],
                candidates: list[tuple[float, int, int]], closed: bool = False) -> None:
        """Extend ks by the prefix of candidates with the best predicted tokens per second.

        closed: no request waits for a slot, so a sequence that finishes early frees a row
        that nobody takes, and the batch is done when its slowest sequences are. An extra token
        then shortens the run only as far as the whole batch advances, which a step
        speculating on a share f of the batch does for about f of its tokens; the others only
        save their row of a later step, worth that row's marginal cost (the measured cost per
        proposal times B, in plain steps: ~0.7 on a CPU at batch 32, where rows cost linearly,
        nearly 0 on a GPU). So extra tokens count f + (1 - f) * that: speculation on a batch
        whose sequences all copy their input still pays, marginal bets on two sequences of
        32 do not (measured: "[ngram]" on chat prompts at batch 32 on the CPU speculated on
        5 % of steps and ran 0.92-0.95x with every token counted fully)."""
        fixed = sum(ks)  # pinned proposals
        if self.costs.plain_time(n) is None:
            return  # this batch size has not been measured yet: this plain step measures it
        points = self.costs.ratio_curve(n)
        # cost[p], p = 0..: a step with p proposals over this batch, in plain steps
        cost = _cost_table(points, fixed + len(candidates), self.costs.switch_penalty(n),
                           self.costs.proposal_prior(n) if PLAIN_ROW_PRIOR else 0.0)
        expected = self._expected(n, ks, accept)
        candidates.sort(key=lambda c: (-c[0], c[1]))  # j-th before (j+1)-th of a sequence
        del candidates[max(explore_limit(points) - fixed, 0):]
        if not candidates:
            return
        # predicted tokens per plain step with the first m candidates, m = 1..len (plain
        # Python, like _cost_table)
        extra = list(accumulate(gain for gain, _, _ in candidates))
        if closed:  # the first candidate of each sequence (j = 1) comes before its others
            value = row_value(points, n)
            firsts = 0
            for m, (_, j, _) in enumerate(candidates):
                firsts += j == 1
                share = firsts / n
                extra[m] *= share + (1.0 - share) * value
        best, best_rate = 0, -math.inf  # the first of equal rates: the fewest proposals
        for m, more in enumerate(extra):
            rate = (expected + more) / cost[fixed + 1 + m]
            if rate > best_rate:
                best, best_rate = m, rate
        best_m = best + 1 if best_rate > self._rate_to_beat(expected, cost, fixed) else 0
        for _, j, i in candidates[:best_m]:
            ks[i] = max(ks[i], j)

    def _probe_pinned(self, seq_ids: list[int], limits: list[int], ks: list[int],
                      pinned: list[bool]) -> None:
        """A pinned sequence of a draft model that stopped proposing gets a one-token probe
        after PROBE_INTERVAL idle steps (doubling with each probe until it speculates on its
        merits again): its acceptance is only learned by verifying, and its schedule may
        depend on nothing but its own history."""
        for i, seq_id in enumerate(seq_ids):
            if not pinned[i]:
                continue
            if ks[i] > 0:
                self.idle_steps[seq_id] = 0
                self.probe_interval.pop(seq_id, None)
                continue
            idle = self.idle_steps.get(seq_id, 0) + 1
            self.idle_steps[seq_id] = idle
            if idle >= self.probe_interval.get(seq_id, PROBE_INTERVAL) and limits[i] > 0:
                self._start_probe(seq_id, ks, i)

    def _start_probe(self, seq_id: int, ks: list[int], i: int) -> None:
        ks[i] = 1
        self.idle_steps[seq_id] = 0
        self.probe_interval[seq_id] = min(2 * self.probe_interval.get(seq_id, PROBE_INTERVAL),
                                          MAX_PROBE_INTERVAL)
