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
  New sequences start from the engine-wide averages.
* **What it costs, measured on this machine.** ``StepCosts`` learns the wall time of the
  target pass as a function of the batch size B and the number of proposals p in it: the plain
  decode time per B, and for speculative steps the ratio t(B, p) / t(B, 0) per (B, p) bucket,
  each the fastest of its recent samples (other load only ever slows a step down). It also
  measures the extra cost of a plain step right after a speculative one (a CPU backend may
  rebuild decode state then) and charges speculative steps with it, in proportion to how often
  speculation is switched off again. Nothing is assumed about the hardware: on a GPU at small
  batch extra query tokens are nearly free and the ratios say so; on a CPU a pass over k+1
  tokens costs 1.5-2x a decode from k = 3 and they say that; at large batches every token
  costs and speculation backs off. Unmeasured (B, p) are interpolated between measured ones;
  past the largest measured p they are extrapolated along the secant from (0, 1) up to 2p + 1
  (so that larger k gets measured when it promises to pay, one doubling at a time) and not
  tried beyond. Samples expire, so the estimates follow the machine's load.

Each step the candidate proposals are sorted by that gain (most likely accepted first) and the
policy keeps the prefix with the highest predicted tokens/second, none if plain decoding is
predicted faster. ``speculative_disable_by_batch_size`` still applies first, as a hard limit.

Sampled requests are *pinned*: with rejection sampling the token at a position depends on
whether it was a proposal or a bonus position, so a sampled request's output is reproducible
(and a seeded one independent of its batch mates) only if its k never depends on measured
timings or on other requests. A pinned sequence proposes j tokens while the gain of the j-th
stays above ``PINNED_MIN_GAIN``, from its own history and a fixed prior.
"""

from __future__ import annotations

import bisect
import math
import statistics
from collections import deque
from dataclasses import dataclass, field

EMA_WEIGHT = 0.3  # weight of the newest verification in a sequence's acceptance average
PRIOR_ACCEPTANCE = 0.5  # pinned sequences, and the engine-wide average before any data
GLOBAL_EMA_WEIGHT = 0.05  # the engine-wide acceptance average that new sequences start from
PINNED_MIN_GAIN = 0.3  # a pinned sequence proposes j tokens while their gain stays above this
PROBE_INTERVAL = 16  # plan-first proposers (draft model): steps between one-token probes
MIN_GAIN = 1.02  # speculate only when predicted >= 2 % faster than plain decoding
SAMPLES_KEPT = 6  # per cost bucket; the estimate is the fastest of them
PLAIN_EXPIRY = 100  # steps after which a plain-decode sample is dropped
RATIO_EXPIRY = 200  # ... a speculative-step cost ratio sample


def batch_bucket(batch_size: int) -> int:
    """Speculative cost ratios are shared within batch sizes 1, 2, 3-4, 5-8, 9-16, ..."""
    return max(batch_size - 1, 0).bit_length()


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

    def low(self, step: int, expiry: int) -> float | None:
        """The smallest unexpired value: other load on the machine only ever slows a step
        down, so the fastest recent time is the best estimate of what the step itself costs."""
        values = self.live(step, expiry)
        return min(values) if values else None


@dataclass
class StepCosts:
    """Measured target-pass times: plain decode per batch size, speculative steps as ratios."""

    step: int = 0  # steps planned so far (the clock samples expire on)
    plain: dict[int, _Samples] = field(default_factory=dict)  # B -> seconds
    ratio: dict[tuple[int, int], _Samples] = field(default_factory=dict)  # (bucket, p) -> t/t0
    after: dict[int, _Samples] = field(default_factory=dict)  # bucket -> plain-after-spec / t0
    switch_rate: float = 1.0  # how often a speculative step is followed by a plain one
    draft_cost_per_token: float = 0.0  # seconds per proposal (draft models), from propose()

    # ---- observations ----------------------------------------------------------------------
    def observe(self, batch_size: int, num_proposals: int, seconds: float,
                after_spec: bool) -> None:
        """One pure decode/verify pass over batch_size sequences with num_proposals in total."""
        b = batch_bucket(batch_size)
        if num_proposals == 0 and not after_spec:
            self.plain.setdefault(batch_size, _Samples()).add(self.step, seconds)
            return
        t0 = self.plain_time(batch_size)
        if t0 is None:
            return
        if num_proposals == 0:
            self.after.setdefault(b, _Samples()).add(self.step, seconds / t0)
        else:
            key = (b, proposal_bucket(num_proposals))
            self.ratio.setdefault(key, _Samples()).add(self.step, (num_proposals, seconds / t0))

    def observe_switch(self, switched_off: bool) -> None:
        self.switch_rate = 0.9 * self.switch_rate + 0.1 * float(switched_off)

    def observe_draft(self, num_proposals: int, seconds: float) -> None:
        if num_proposals:
            per_token = seconds / num_proposals
            self.draft_cost_per_token = (per_token if self.draft_cost_per_token == 0.0 else
                                         0.8 * self.draft_cost_per_token + 0.2 * per_token)

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

    def ratio_curve(self, batch_size: int) -> list[tuple[float, float]]:
        """Measured (p, t(B, p) / t(B, 0)) points of B's bucket, (0, 1) first."""
        b = batch_bucket(batch_size)
        points = [(0.0, 1.0)]
        for (bucket, _), samples in sorted(self.ratio.items()):
            values = samples.live(self.step, RATIO_EXPIRY) if bucket == b else None
            if values:
                points.append((statistics.median(p for p, _ in values),
                               min(r for _, r in values)))
        return points

    def switch_penalty(self, batch_size: int) -> float:
        """Expected extra cost (in plain steps) that one speculative step causes afterwards."""
        samples = self.after.get(batch_bucket(batch_size))
        r = None if samples is None else samples.low(self.step, RATIO_EXPIRY)
        return 0.0 if r is None else max(r - 1.0, 0.0) * self.switch_rate


def proposal_bucket(p: int) -> int:
    """Cost ratios are kept per proposal count up to 8, then per ~25 % wide bucket."""
    if p <= 8:
        return p
    return 8 + round(4 * math.log2(p / 8))


def _cost_ratio(points: list[tuple[float, float]], p: int) -> float | None:
    """t(B, p) / t(B, 0) from measured points, linear in between. Past the largest measured
    p = x it is extrapolated up to 2x + 1 (how larger k gets measured at all, one doubling per
    step that tries it) and unknown (None: not allowed) beyond."""
    xs = [x for x, _ in points]
    i = bisect.bisect_left(xs, p)
    if i < len(points):
        if xs[i] == p:
            return points[i][1]
        (x0, y0), (x1, y1) = points[i - 1], points[i]
        return y0 + (y1 - y0) * (p - x0) / (x1 - x0)
    x_last, y_last = points[-1]
    if p > 2 * x_last + 1:
        return None
    # Extended along the secant from plain decoding (0, 1) through the last measured point:
    # each further proposal costs what the measured ones cost on average.
    slope = max(y_last - 1.0, 0.0) / x_last if x_last else 0.0
    return y_last + slope * (p - x_last)


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

    # ---- acceptance ------------------------------------------------------------------------
    def record(self, seq_id: int, num_proposed: int, num_accepted: int) -> None:
        """Update a sequence's averages from one verified (or shadow) proposal run."""
        if num_proposed == 0:
            return
        est = self.acceptance.setdefault(seq_id, list(self.global_acceptance))
        first = float(num_accepted > 0)
        # Continuations tried: proposals 2.. whose predecessor was accepted.
        trials = min(num_accepted, num_proposed - 1)
        for target in (est, self.global_acceptance):
            w = EMA_WEIGHT if target is est else GLOBAL_EMA_WEIGHT
            target[0] += w * (first - target[0])
            if trials > 0:
                target[1] += w * ((num_accepted - 1) / trials - target[1])

    def forget(self, seq_id: int) -> None:
        self.acceptance.pop(seq_id, None)
        self.idle_steps.pop(seq_id, None)

    def _acceptance(self, seq_id: int, pinned: bool) -> list[float]:
        """A sequence's averages, started at its first plan: pinned ones from a fixed prior
        (their k must never depend on what other requests did), others from the engine-wide
        averages."""
        prior = [PRIOR_ACCEPTANCE, PRIOR_ACCEPTANCE] if pinned else self.global_acceptance
        return self.acceptance.setdefault(seq_id, list(prior))

    @staticmethod
    def gain(acceptance: list[float], j: int) -> float:
        """Expected tokens the j-th proposal adds: P(proposals 1..j all accepted)."""
        return acceptance[0] * acceptance[1] ** (j - 1)

    # ---- planning --------------------------------------------------------------------------
    def plan(self, seq_ids: list[int], limits: list[int], pinned: list[bool] | None = None,
             probe: bool = False) -> list[int]:
        """Proposals per decoding sequence (each <= its limit: the hard cap, or for draft-free
        methods the length of the proposal already found). probe=True gives a sequence that
        has not proposed for PROBE_INTERVAL steps one proposal (plan-first proposers, whose
        declined proposals cannot be scored for free)."""
        self.costs.step += 1
        n = len(seq_ids)
        pinned = pinned or [False] * n
        ks = [0] * n
        accept = [self._acceptance(s, p) for s, p in zip(seq_ids, pinned, strict=True)]
        candidates = []  # (gain of the j-th proposal of sequence i, j, i)
        for i in range(n):
            limit = min(limits[i], self.max_k)
            if pinned[i]:
                ks[i] = max((j for j in range(1, limit + 1)
                             if self.gain(accept[i], j) >= PINNED_MIN_GAIN), default=0)
            else:
                candidates.extend((self.gain(accept[i], j), j, i) for j in range(1, limit + 1))
        if candidates:
            self._choose(n, ks, accept, candidates)
        if probe:
            self._probe(seq_ids, limits, ks)
        return ks

    def _choose(self, n: int, ks: list[int], accept: list[list[float]],
                candidates: list[tuple[float, int, int]]) -> None:
        """Extend ks by the prefix of candidates with the best predicted tokens per second."""
        t0 = self.costs.plain_time(n)
        if t0 is None:
            return  # this batch size has not been measured yet: this plain step measures it
        points = self.costs.ratio_curve(n)
        penalty = self.costs.switch_penalty(n)
        draft = self.costs.draft_cost_per_token / t0

        def cost(p: int) -> float | None:  # in plain-step units
            if p == 0:
                return 1.0
            ratio = _cost_ratio(points, p)
            return None if ratio is None else ratio + penalty + draft * p

        fixed = sum(ks)  # pinned proposals
        expected = n + sum(sum(self.gain(a, j) for j in range(1, k + 1))
                           for a, k in zip(accept, ks, strict=True))
        base = cost(fixed)
        if base is None:  # pinned proposals alone go past what was measured: explore no further
            return
        best_rate, best_m = expected / base * (MIN_GAIN if fixed == 0 else 1.0), 0
        candidates.sort(key=lambda c: (-c[0], c[1]))  # j-th before (j+1)-th of a sequence
        for m, (gain, _, _) in enumerate(candidates, start=1):
            expected += gain
            c = cost(fixed + m)
            if c is None:
                break
            if expected / c > best_rate:
                best_rate, best_m = expected / c, m
        for _, j, i in candidates[:best_m]:
            ks[i] = max(ks[i], j)

    def _probe(self, seq_ids: list[int], limits: list[int], ks: list[int]) -> None:
        for i, seq_id in enumerate(seq_ids):
            if ks[i] > 0:
                self.idle_steps[seq_id] = 0
                continue
            idle = self.idle_steps.get(seq_id, 0) + 1
            self.idle_steps[seq_id] = idle
            if idle >= PROBE_INTERVAL and limits[i] > 0:
                ks[i] = 1
                self.idle_steps[seq_id] = 0
