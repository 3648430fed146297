"""Benchmark-only proposer: controlled acceptance at the real cost of a draft model.

To measure speculative speedup as a function of the acceptance rate, the proposals must be
accepted at a chosen rate while the step still pays what a real draft costs. This proposer runs
the draft model exactly as ``DraftModelProposer`` does (same forwards, same sampling, same
syncs), then replaces each sampled token by the target's own greedy continuation (recorded
beforehand), corrupted independently with probability ``1 - acceptance``. For greedy requests
the per-position acceptance is then ``acceptance`` and the draft is fed the replayed tokens.

It is NOT a speculation method: no user-facing option or factory reaches it, and constructing
one raises unless the environment variable ``SPECSERVE_BENCHMARK_PROPOSER=1`` is set. The
benchmark (benchmarks/bench_gpu_spec.py) swaps it into an engine built with a draft model.
"""

from __future__ import annotations

import os
import random
from collections.abc import Mapping, Sequence

from specserve.engine.sequence import Sequence as Seq
from specserve.sampling_params import SamplingType
from specserve.spec_decode.draft_model import DraftModelProposer
from specserve.worker.model_runner import SequenceRun
from specserve.worker.transfer import to_device

ENV_FLAG = "SPECSERVE_BENCHMARK_PROPOSER"


class ReplayProposer(DraftModelProposer):
    """Pays for the draft model, proposes the target's recorded greedy tokens (corrupted)."""

    def __init__(self, draft: DraftModelProposer,
                 continuations: Mapping[tuple[int, ...], Sequence[int]],
                 acceptance: float, seed: int = 0) -> None:
        if os.environ.get(ENV_FLAG) != "1":
            raise RuntimeError(f"ReplayProposer is for benchmarks only; set {ENV_FLAG}=1.")
        if not 0.0 <= acceptance <= 1.0:
            raise ValueError(f"acceptance={acceptance!r} must be in [0, 1].")
        super().__init__(draft.runner, draft.block_manager, draft.vocab_size,
                         draft.default_generator, draft.blocked_token_ids,
                         draft.max_model_len)
        self.shadows = draft.shadows  # take over the draft's state (shadow sequences, blocks)
        self.continuations = {tuple(k): list(v) for k, v in continuations.items()}
        # seq_id -> its continuation, looked up once per sequence: keying the dict by a tuple
        # of the prompt on every replayed token cost ~3 us each, ~0.1 ms of host time per
        # batch-32 step that a real draft model does not spend. (Sequence ids are never
        # reused; the cache is also cleared with the counts, before every measured run.)
        self._by_seq: dict[int, list[int]] = {}
        self.acceptance = acceptance
        self.rng = random.Random(seed)
        self.reset_counts()

    def reset_counts(self) -> None:
        self._by_seq.clear()
        self.num_accepted = 0  # proposals accepted
        self.num_rejections = 0  # verifications that stopped at a rejected proposal
        self.num_steps = 0  # verifications with at least one proposal

    @property
    def per_token_acceptance(self) -> float:
        """Estimate of the per-position acceptance probability a (the ideal formula's): each
        proposal reached is accepted with probability a, so a = accepted / (accepted +
        rejections); a verification that accepted all k saw no rejection."""
        return self.num_accepted / max(self.num_accepted + self.num_rejections, 1)

    def _replay(self, seq: Seq, num_drafted: int) -> int:
        """The recorded greedy token at this position, or (with prob 1 - acceptance) another."""
        cont = self._by_seq.get(seq.seq_id)
        if cont is None:
            cont = self._by_seq[seq.seq_id] = self.continuations.get(
                tuple(seq.prompt_token_ids), [])
        i = seq.num_output_tokens + num_drafted
        token = cont[i] if i < len(cont) else 0
        if self.rng.random() >= self.acceptance:
            token = (token + 1 + self.rng.randrange(self.vocab_size - 1)) % self.vocab_size
        return token

    def on_verified(self, seq: Seq, num_tokens_before: int, num_proposed: int,
                    num_accepted: int) -> None:
        if num_proposed:
            self.num_steps += 1
            self.num_accepted += num_accepted
            self.num_rejections += num_accepted < num_proposed
        super().on_verified(seq, num_tokens_before, num_proposed, num_accepted)

    def _step_tokens(self, seqs: list[Seq], drafted: list[list[int]],
                     runs: list[SequenceRun], greedy: bool):
        assert all(s.params.sampling_type is SamplingType.GREEDY for s in seqs), \
            "the replay proposer only models greedy requests"
        probs, _ = super()._step_tokens(seqs, drafted, runs, greedy)  # the real draft cost
        return probs, [self._replay(s, len(d)) for s, d in zip(seqs, drafted, strict=True)]

    def _device_tokens(self, seqs: list[Seq], active: list[int], tokens,
                       first_position: int = 0):
        """The real drafting ran on the device (its cost); its tokens are replaced by replayed
        ones, drawn in the host path's order (proposal 1 of every sequence, then the rest)."""
        k, end = first_position, first_position + tokens.shape[1]
        first = [self._replay(seqs[i], k) for i in active]
        rest = [[self._replay(seqs[i], j) for j in range(k + 1, end)] for i in active]
        host = [[f, *r] for f, r in zip(first, rest, strict=True)]
        return to_device(host, tokens.dtype, tokens.device)

    def _propose_window(self, seqs: list[Seq], active: list[int],
                        proposals: list[list[int]], num_steps: int) -> None:
        """The real window (its cost), then proposals 2..k replaced by replayed tokens. The
        draft's own argmax tokens were fed inside the window, so its KV holds those rather than
        the replayed ones: only the draft's later predictions differ, and they are replaced."""
        super()._propose_window(seqs, active, proposals, num_steps)
        for i in active:
            del proposals[i][1:]
            for j in range(1, num_steps + 1):
                proposals[i].append(self._replay(seqs[i], j))
