"""Adaptive speculation: how many tokens each sequence proposes, every step.

Two things decide whether a proposal pays:

* how likely it is to be accepted. Each sequence keeps an exponential moving average ``a`` of
  its per-token acceptance rate; its j-th proposal is accepted (all earlier ones too) with
  probability about ``a**j``, which is also the expected number of extra tokens it brings;
* what it costs. Verification scores every proposal in the target's forward pass; while the
  hardware has idle capacity (small batches on a GPU) extra query tokens are almost free, but
  once the batch fills it the pass gets longer with every token. An online linear model
  ``t(step) = t0 + t1 * tokens`` (+ a per-proposal draft cost) is fitted to measured steps.

Each step the policy hands out proposals one at a time, most-likely-accepted first, while the
predicted tokens/second of the step keeps rising. At small batches this gives every sequence its
full k when its acceptance is high; at large batches, where ``t1 * tokens`` dominates, it backs
off to the few sequences that accept reliably, or to none, so speculation never makes the engine
slower than plain decoding. ``speculative_disable_by_batch_size`` still applies first, as a hard
limit. A sequence whose average fell low still gets a single probe proposal now and then so that
it can recover when its text becomes predictable.
"""

from __future__ import annotations

from dataclasses import dataclass, field

EMA_WEIGHT = 0.3  # weight of the newest step in the acceptance average
PRIOR_ACCEPTANCE = 0.6  # before a sequence has been measured
PINNED_MIN_GAIN = 0.3  # a pinned sequence proposes j tokens while a**j stays above this
PROBE_INTERVAL = 8  # steps between probe proposals for a sequence that stopped speculating
MIN_SAMPLES_FOR_FIT = 8
COST_MEMORY = 64  # recent steps used to fit the cost model


@dataclass
class StepCostModel:
    """Least-squares fit of step time against the number of tokens in the step."""

    samples: list[tuple[int, float]] = field(default_factory=list)
    draft_cost_per_token: float = 0.0  # seconds per proposal, measured from propose() calls
    _fit: tuple[float, float] | None = None

    def observe(self, num_tokens: int, seconds: float) -> None:
        self.samples.append((num_tokens, seconds))
        if len(self.samples) > COST_MEMORY:
            del self.samples[0]
        self._fit = None

    def observe_draft(self, num_proposals: int, seconds: float) -> None:
        if num_proposals:
            per_token = seconds / num_proposals
            self.draft_cost_per_token = (per_token if self.draft_cost_per_token == 0.0 else
                                         0.8 * self.draft_cost_per_token + 0.2 * per_token)

    def coefficients(self) -> tuple[float, float] | None:
        """(t0, t1), or None while there is not enough spread in the data to fit."""
        if self._fit is not None:
            return self._fit
        if len(self.samples) < MIN_SAMPLES_FOR_FIT:
            return None
        xs = [float(n) for n, _ in self.samples]
        ys = [t for _, t in self.samples]
        mean_x, mean_y = sum(xs) / len(xs), sum(ys) / len(ys)
        var = sum((x - mean_x) ** 2 for x in xs)
        if var == 0.0:
            return None
        slope = sum((x - mean_x) * (y - mean_y) for x, y in zip(xs, ys, strict=True)) / var
        slope = max(slope, 0.0)
        intercept = max(mean_y - slope * mean_x, 1e-6)
        self._fit = (intercept, slope)
        return self._fit

    def step_time(self, num_tokens: int, num_proposals: int) -> float | None:
        coef = self.coefficients()
        if coef is None:
            return None
        t0, t1 = coef
        return t0 + t1 * num_tokens + self.draft_cost_per_token * num_proposals


@dataclass
class AdaptiveSpeculation:
    max_k: int
    costs: StepCostModel = field(default_factory=StepCostModel)
    acceptance: dict[int, float] = field(default_factory=dict)  # seq_id -> EMA
    idle_steps: dict[int, int] = field(default_factory=dict)  # seq_id -> steps without proposing

    def record(self, seq_id: int, num_proposed: int, num_accepted: int) -> None:
        """Update a sequence's acceptance average from one verified step."""
        if num_proposed == 0:
            return
        rate = num_accepted / num_proposed
        old = self.acceptance.get(seq_id, PRIOR_ACCEPTANCE)
        self.acceptance[seq_id] = (1 - EMA_WEIGHT) * old + EMA_WEIGHT * rate

    def forget(self, seq_id: int) -> None:
        self.acceptance.pop(seq_id, None)
        self.idle_steps.pop(seq_id, None)

    def plan(self, seq_ids: list[int], limits: list[int], other_tokens: int,
             pinned: list[bool] | None = None) -> list[int]:
        """Proposals per sequence (each <= its limit). other_tokens: tokens already in the step
        (one per decoding sequence plus any prompt chunks).

        Pinned sequences (sampled requests) get a k that depends on their own history only:
        with rejection sampling the token at a position depends on whether it was a proposal
        or a bonus position, so a sampled request's output is reproducible (and a seeded one
        independent of its batch mates) only if its k never depends on measured timings."""
        pinned = pinned or [False] * len(seq_ids)
        ks = [0] * len(seq_ids)
        # Candidates (probability the j-th proposal of sequence i is accepted, i, j).
        candidates = []
        for i, (seq_id, limit) in enumerate(zip(seq_ids, limits, strict=True)):
            a = self.acceptance.get(seq_id, PRIOR_ACCEPTANCE)
            if pinned[i]:
                ks[i] = max((j for j in range(min(limit, self.max_k) + 1)
                             if a**j >= PINNED_MIN_GAIN), default=0)
                continue
            for j in range(1, min(limit, self.max_k) + 1):
                candidates.append((a**j, i, j))
        candidates.sort(key=lambda c: -c[0])
        base_tokens = float(len(seq_ids))  # each decoding sequence emits at least one token
        proposals = sum(ks)  # pinned sequences' proposals are fixed costs
        expected = base_tokens + sum(
            sum(self.acceptance.get(seq_ids[i], PRIOR_ACCEPTANCE) ** j for j in range(1, k + 1))
            for i, k in enumerate(ks))
        best_rate = self._rate(expected, other_tokens, proposals)
        for gain, i, j in candidates:
            if j != ks[i] + 1:
                continue  # proposal j only makes sense after 1..j-1
            rate = self._rate(expected + gain, other_tokens + proposals + 1, proposals + 1)
            if best_rate is not None and rate is not None and rate <= best_rate:
                continue
            ks[i] = j
            expected += gain
            proposals += 1
            best_rate = rate
        self._probe(seq_ids, limits, ks)
        return ks

    def _rate(self, expected_tokens: float, num_tokens: int, num_proposals: int) -> float | None:
        t = self.costs.step_time(num_tokens, num_proposals)
        return None if t is None else expected_tokens / t

    def _probe(self, seq_ids: list[int], limits: list[int], ks: list[int]) -> None:
        """A sequence that has not speculated for a while proposes one token to re-measure."""
        for i, seq_id in enumerate(seq_ids):
            if ks[i] > 0:
                self.idle_steps[seq_id] = 0
                continue
            idle = self.idle_steps.get(seq_id, 0) + 1
            self.idle_steps[seq_id] = idle
            if idle >= PROBE_INTERVAL and limits[i] > 0:
                ks[i] = 1
                self.idle_steps[seq_id] = 0
