"""Speculative decoding metrics with vLLM's definitions.

* draft acceptance rate = accepted / drafted proposals
* system efficiency = emitted / the most that could have been emitted (steps x (k + 1))
* mean acceptance length = emitted tokens per speculative sequence-step (1 .. k + 1)
* per-position acceptance rate = how often proposal j was accepted when proposed
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field, replace

logger = logging.getLogger("specserve.spec_decode")


@dataclass
class SpecDecodeCounters:
    num_spec_steps: int = 0  # sequence-steps that verified >= 1 proposal
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    num_emitted_tokens: int = 0
    max_num_emitted_tokens: int = 0  # sum over sequence-steps of (k + 1)
    num_non_spec_decode_steps: int = 0  # decodes that did not speculate (limits, no proposal)
    num_past_spec_max_len: int = 0  # of which: past speculative_max_model_len
    accepted_per_position: list[int] = field(default_factory=list)
    drafted_per_position: list[int] = field(default_factory=list)

    @property
    def acceptance_rate(self) -> float:
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    @property
    def system_efficiency(self) -> float:
        return (self.num_emitted_tokens / self.max_num_emitted_tokens
                if self.max_num_emitted_tokens else 0.0)

    @property
    def mean_acceptance_length(self) -> float:
        return self.num_emitted_tokens / self.num_spec_steps if self.num_spec_steps else 0.0

    @property
    def per_position_acceptance_rate(self) -> list[float]:
        return [a / d if d else 0.0 for a, d in zip(self.accepted_per_position,
                                                    self.drafted_per_position, strict=True)]

    def minus(self, other: SpecDecodeCounters) -> SpecDecodeCounters:
        """Counts accumulated since the snapshot `other` (for per-interval rates)."""
        delta = replace(self)
        for name in ("num_spec_steps", "num_draft_tokens", "num_accepted_tokens",
                     "num_emitted_tokens", "max_num_emitted_tokens", "num_non_spec_decode_steps",
                     "num_past_spec_max_len"):
            setattr(delta, name, getattr(self, name) - getattr(other, name))
        pad = len(self.accepted_per_position) - len(other.accepted_per_position)
        delta.accepted_per_position = [a - b for a, b in zip(
            self.accepted_per_position, other.accepted_per_position + [0] * pad, strict=True)]
        delta.drafted_per_position = [a - b for a, b in zip(
            self.drafted_per_position, other.drafted_per_position + [0] * pad, strict=True)]
        return delta

    def as_dict(self) -> dict[str, object]:
        return {
            "num_spec_steps": self.num_spec_steps,
            "num_draft_tokens": self.num_draft_tokens,
            "num_accepted_tokens": self.num_accepted_tokens,
            "num_emitted_tokens": self.num_emitted_tokens,
            "num_non_spec_decode_steps": self.num_non_spec_decode_steps,
            "num_past_spec_max_len": self.num_past_spec_max_len,
            "draft_acceptance_rate": self.acceptance_rate,
            "system_efficiency": self.system_efficiency,
            "mean_acceptance_length": self.mean_acceptance_length,
            "per_position_acceptance_rate": self.per_position_acceptance_rate,
            "accepted_per_position": list(self.accepted_per_position),
            "drafted_per_position": list(self.drafted_per_position),
        }


class SpecDecodeMetrics:
    """Cumulative counters plus a periodic one-line log of the last interval."""

    def __init__(self, num_speculative_tokens: int, log_interval_s: float = 5.0) -> None:
        self.k = num_speculative_tokens
        self.total = SpecDecodeCounters(accepted_per_position=[0] * self.k,
                                        drafted_per_position=[0] * self.k)
        self._last_snapshot = replace(self.total, accepted_per_position=[0] * self.k,
                                      drafted_per_position=[0] * self.k)
        self._last_log = time.monotonic()
        self.log_interval_s = log_interval_s

    def record(self, num_proposed: int, num_accepted: int, num_emitted: int) -> None:
        """One sequence-step. num_emitted counts tokens committed (a stop may cut the run)."""
        t = self.total
        if num_proposed == 0:
            t.num_non_spec_decode_steps += 1
            return
        t.num_spec_steps += 1
        t.num_draft_tokens += num_proposed
        t.num_accepted_tokens += num_accepted
        t.num_emitted_tokens += num_emitted
        t.max_num_emitted_tokens += num_proposed + 1
        for j in range(num_proposed):
            t.drafted_per_position[j] += 1
            if j < num_accepted:
                t.accepted_per_position[j] += 1

    def interval(self) -> SpecDecodeCounters:
        """Counters since the previous call (and start a new interval)."""
        snapshot = replace(self.total, accepted_per_position=list(self.total.accepted_per_position),
                           drafted_per_position=list(self.total.drafted_per_position))
        delta = snapshot.minus(self._last_snapshot)
        self._last_snapshot = snapshot
        return delta

    def maybe_log(self, force: bool = False) -> str | None:
        now = time.monotonic()
        if not force and now - self._last_log < self.log_interval_s:
            return None
        self._last_log = now
        line = self.format_line(self.interval())
        logger.info(line)
        return line

    def format_line(self, window: SpecDecodeCounters) -> str:
        t = self.total
        per_pos = ", ".join(f"{r:.2f}" for r in window.per_position_acceptance_rate)
        return (f"Speculative metrics: Draft acceptance rate: {window.acceptance_rate:.3f} "
                f"(cumulative {t.acceptance_rate:.3f}), System efficiency: "
                f"{window.system_efficiency:.3f}, Mean acceptance length: "
                f"{window.mean_acceptance_length:.2f}, Per-position acceptance: [{per_pos}], "
                f"Number of speculative tokens: {self.k}, Number of accepted tokens: "
                f"{t.num_accepted_tokens}, Number of draft tokens: {t.num_draft_tokens}, "
                f"Number of emitted tokens: {t.num_emitted_tokens}.")
