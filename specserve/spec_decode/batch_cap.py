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
min(c, its own k) tokens, at least one, which keeps the draft in step with all of them. Each
cap's speedup over plain decoding is measured on the steps that ran it, as (tokens emitted per
sequence, averaged) / (fastest step time / plain step time), per batch-size bucket. The
planner runs the cap with the best measured speedup and tries each neighbour of it twice
(speedup is unimodal in c: each further proposal is accepted less often and costs more), and
the largest cap twice while plain decoding is best (a draft that only pays with several
proposals). Measurements expire, so caps are tried again as acceptance and load change.
"""

from __future__ import annotations

from dataclasses import dataclass, field

MIN_SPEEDUP = 1.02  # a cap must beat plain decoding by this much to be run (noise margin)
CAP_EXPIRY = 200  # steps after which a cap's speedup sample is dropped
CAP_SAMPLES = 8  # kept per (batch bucket, cap)
TRIES_PER_CAP = 2  # measured steps before a neighbour of the best cap is judged


def batch_bucket(batch_size: int) -> int:
    """Batch sizes 1, 2, 3-4, 5-8, 9-16, ... share measurements."""
    return max(batch_size - 1, 0).bit_length()


@dataclass
class CapSpeedups:
    # (batch bucket, cap) -> [(step, tokens per sequence, step time / plain step time)]
    samples: dict[tuple[int, int], list[tuple[int, float, float]]] = field(default_factory=dict)

    def observe(self, step: int, batch_size: int, cap: int, emitted: int, seconds: float,
                plain_seconds: float) -> None:
        """One pure decode/verify step that ran `cap` over batch_size sequences."""
        kept = self.samples.setdefault((batch_bucket(batch_size), cap), [])
        kept.append((step, emitted / batch_size, seconds / plain_seconds))
        del kept[:-CAP_SAMPLES]

    def _live(self, step: int, batch_size: int, cap: int) -> list[tuple[int, float, float]]:
        kept = self.samples.get((batch_bucket(batch_size), cap), [])
        kept[:] = [s for s in kept if s[0] >= step - CAP_EXPIRY]
        return kept

    def speedup(self, step: int, batch_size: int, cap: int) -> float | None:
        """Tokens per sequence over step time (in plain steps) with this cap, against plain
        decoding's one token per plain step; None if untried. The tokens are averaged (their
        spread is acceptance's coin flips, both ways), the time is the fastest measured (other
        load on the host only ever slows a step down: one stalled step must not condemn a cap,
        and plain steps are priced the same way)."""
        if cap == 0:
            return 1.0
        kept = self._live(step, batch_size, cap)
        if not kept:
            return None
        return sum(t for _, t, _ in kept) / len(kept) / min(r for _, _, r in kept)

    def choose(self, step: int, batch_size: int, max_k: int) -> int:
        """The cap to run this step: a neighbour of the best measured one while it has fewer
        than TRIES_PER_CAP measurements (one step is noisy: acceptance is a coin flip per
        proposal), else the best (plain decoding unless a cap beats it by MIN_SPEEDUP)."""
        measured = {c: s for c in range(max_k + 1)
                    if (s := self.speedup(step, batch_size, c)) is not None}
        best = max(measured, key=lambda c: measured[c] / (1.0 if c == 0 else MIN_SPEEDUP))
        for c in (best + 1, best - 1) + ((max_k,) if best == 0 else ()):
            if 1 <= c <= max_k and len(self._live(step, batch_size, c)) < TRIES_PER_CAP:
                return c
        return best
