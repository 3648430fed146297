"""Continuous batching under a token budget, with chunked prefill and preemption by recompute.

Each step: running sequences first (oldest first; decodes and unfinished prompt chunks), then
waiting ones while the token budget, ``max_num_seqs`` and free blocks allow. When a running
sequence cannot get a block, the newest running sequence is preempted: its blocks are freed and
it goes back to the front of the queue to be recomputed later (its tokens are kept).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from specserve.engine.block_manager import BlockManager
from specserve.engine.sequence import Sequence, SequenceStatus


@dataclass
class ScheduledSequence:
    seq: Sequence
    num_new_tokens: int  # tokens whose K/V this step computes, from seq.num_computed_tokens
    num_lookahead: int = 0  # extra slots reserved for speculative proposals (decodes only)

    @property
    def samples(self) -> bool:
        """True when this chunk reaches the end of the known tokens, so a token is sampled."""
        return self.seq.num_computed_tokens + self.num_new_tokens == self.seq.num_tokens


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledSequence] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled

    @property
    def num_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.scheduled)


class Scheduler:
    def __init__(self, block_manager: BlockManager, max_num_seqs: int,
                 max_num_batched_tokens: int, num_lookahead_slots: int = 0,
                 max_model_len: int | None = None, budget_lookahead: bool = True) -> None:
        self.block_manager = block_manager
        # Speculation verifies k proposals per decoding sequence: each decode reserves k extra
        # KV slots and k extra tokens of budget ("lookahead"); unused ones are rolled back.
        # A sequence of T tokens can still gain max_model_len - T, so it never needs more than
        # max_model_len - T - 1 lookahead slots (the last token is never fed back).
        self.num_lookahead_slots = num_lookahead_slots
        # budget_lookahead=False (multi-step decoding): the lookahead slots are the KV of the
        # window's later forwards, each of them one token per sequence, so they cost no token
        # budget; and they are reserved only when nobody waits (the engine runs no window then).
        self.budget_lookahead = budget_lookahead
        self.max_model_len = max_model_len
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0

    # ---- queue management --------------------------------------------------------------------
    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def is_closed(self) -> bool:
        """No request waits for a running one to finish: every waiting request fits in the
        batch (max_num_seqs) and waits only for prefill budget. Speculation then prices its
        steps by when the batch ends (spec_decode/adaptive.py), from the first step of a
        batch whose prompts are prefilled in chunks, not only once the last one started."""
        return len(self.waiting) + len(self.running) <= self.max_num_seqs

    def finish(self, seq: Sequence) -> None:
        """Remove a finished or aborted sequence and return its blocks."""
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self.block_manager.free(seq)

    # ---- one step ----------------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.max_num_batched_tokens
        bm = self.block_manager
        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            num_new = min(seq.num_tokens - seq.num_computed_tokens, budget)
            lookahead = 0
            if num_new == seq.num_tokens - seq.num_computed_tokens == 1:
                if self.budget_lookahead:
                    lookahead = min(self.num_lookahead_slots, budget - 1)
                elif not self.waiting:
                    lookahead = self.num_lookahead_slots
                if self.max_model_len is not None:
                    lookahead = max(0, min(lookahead, self.max_model_len - seq.num_tokens - 1))
            target = seq.num_computed_tokens + num_new + lookahead
            while not bm.can_grow(seq, target) and self.running[-1] is not seq:
                self._preempt(self.running.pop(), out)
            if not bm.can_grow(seq, target):
                self._preempt(self.running.pop(), out)  # seq itself: nothing left to take from
                break
            bm.grow(seq, target)
            out.scheduled.append(ScheduledSequence(seq, num_new, lookahead))
            budget -= num_new + (lookahead if self.budget_lookahead else 0)
            i += 1
        if out.preempted:
            return out  # memory is tight: let the running set drain before admitting more
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            seq = self.waiting[0]
            # Admit only when the whole known sequence fits, so admission never forces an
            # immediate preemption; prompt chunks then draw on blocks that are really free.
            if not bm.can_admit(seq, seq.num_tokens + 1):
                break
            self.waiting.popleft()
            bm.allocate_prefix(seq)
            num_new = min(seq.num_tokens - seq.num_computed_tokens, budget)
            bm.grow(seq, seq.num_computed_tokens + num_new)
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            out.scheduled.append(ScheduledSequence(seq, num_new))
            budget -= num_new
        return out

    def _preempt(self, seq: Sequence, out: SchedulerOutput) -> None:
        self.block_manager.free(seq)
        seq.reset_for_recompute()
        self.waiting.appendleft(seq)
        out.preempted.append(seq)
        self.num_preemptions += 1
