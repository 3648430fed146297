"""The speculative side of an engine step: who proposes how much, and bookkeeping afterwards.

The engine stays method-agnostic: it asks for proposals, scores them in its one target pass,
lets the verifier pick the tokens, commits them, and reports back here.
"""

from __future__ import annotations

import time

import torch

from specserve.engine.scheduler import ScheduledSequence
from specserve.engine.sequence import Sequence
from specserve.outputs import RequestMetrics
from specserve.sampling_params import SamplingType
from specserve.spec_decode.adaptive import AdaptiveSpeculation
from specserve.spec_decode.metrics import SpecDecodeMetrics
from specserve.spec_decode.proposer import Proposer
from specserve.spec_decode.spec_config import SpeculativeConfig


class SpeculationDriver:
    def __init__(self, spec: SpeculativeConfig, proposer: Proposer, max_model_len: int,
                 spec_max_model_len: int) -> None:
        self.spec = spec
        self.proposer = proposer
        self.max_model_len = max_model_len
        self.spec_max_model_len = spec_max_model_len
        self.metrics = SpecDecodeMetrics(spec.num_speculative_tokens)
        self.adaptive = (AdaptiveSpeculation(spec.num_speculative_tokens)
                         if spec.adaptive else None)

    # ---- before the target pass ------------------------------------------------------------
    def _limit(self, s: ScheduledSequence, batch_size: int) -> int:
        """Hard cap on proposals for one decoding sequence (0: plain decode this step)."""
        seq, spec = s.seq, self.spec
        if spec.disable_by_batch_size is not None and batch_size >= spec.disable_by_batch_size:
            return 0
        k = s.num_lookahead
        if seq.params.max_tokens is not None:
            k = min(k, seq.params.max_tokens - seq.num_output_tokens - 1)
        k = min(k, self.max_model_len - seq.num_tokens - 1)
        if k > 0 and seq.num_tokens + k > self.spec_max_model_len:
            self.metrics.total.num_past_spec_max_len += 1
            return 0
        return max(k, 0)

    def propose(self, scheduled: list[ScheduledSequence], sampled: list[ScheduledSequence]
                ) -> tuple[list[list[int]], torch.Tensor | None]:
        """Proposals per sampled sequence ([] for none) and their distributions ([S, K, V])."""
        proposals: list[list[int]] = [[] for _ in sampled]
        decoding = [(i, s) for i, s in enumerate(sampled) if s.num_lookahead > 0]
        ks = [self._limit(s, len(scheduled)) for _, s in decoding]
        if self.adaptive is not None and any(ks):
            other_tokens = sum(s.num_new_tokens for s in scheduled)
            pinned = [s.seq.params.sampling_type is not SamplingType.GREEDY for _, s in decoding]
            ks = self.adaptive.plan([s.seq.seq_id for _, s in decoding], ks, other_tokens,
                                    pinned)
        if not any(ks):
            return proposals, None
        t0 = time.perf_counter()
        out = self.proposer.propose([s.seq for _, s in decoding], ks)
        if self.adaptive is not None:
            self.adaptive.costs.observe_draft(sum(ks), time.perf_counter() - t0)
        draft_probs = None
        if out.probs is not None:
            draft_probs = out.probs.new_zeros(len(sampled), *out.probs.shape[1:])
            index = torch.tensor([i for i, _ in decoding], device=out.probs.device)
            draft_probs[index] = out.probs
        for (i, _), tokens in zip(decoding, out.token_ids, strict=True):
            proposals[i] = tokens
        return proposals, draft_probs

    # ---- after it --------------------------------------------------------------------------
    def observe_forward(self, num_tokens: int, seconds: float) -> None:
        if self.adaptive is not None:
            self.adaptive.costs.observe(num_tokens, seconds)

    def on_committed(self, seq: Sequence, metrics: RequestMetrics, num_tokens_before: int,
                     num_proposed: int, num_accepted: int, num_committed: int) -> None:
        self.proposer.on_verified(seq, num_tokens_before, num_proposed, num_accepted)
        self.metrics.record(num_proposed, num_accepted, num_committed)
        if self.adaptive is not None:
            self.adaptive.record(seq.seq_id, num_proposed, num_accepted)
        if num_proposed:
            metrics.num_spec_steps += 1
            metrics.num_draft_tokens += num_proposed
            metrics.num_accepted_tokens += min(num_accepted, num_committed)
            metrics.num_emitted_tokens += num_committed

    def free(self, seq: Sequence) -> None:
        self.proposer.free(seq)
        if self.adaptive is not None:
            self.adaptive.forget(seq.seq_id)

    def stats(self) -> dict[str, object]:
        stats = self.metrics.total.as_dict()
        stats["num_speculative_tokens"] = self.metrics.k
        return stats
