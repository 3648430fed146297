"""The next step's verification pass, launched at the end of the step before it.

Why: at batch 32 on an H200 a speculative step of a draft model (cap 1) took 8.75 ms of wall
time for 6.66 ms of GPU work, where a plain step took 6.21 for 5.03 (BENCHMARKS.md, session 19):
after a verification is read, the host commits and detokenizes the step's tokens, builds the
outputs, schedules, plans and stages the next target pass, and while it does the GPU has only
the draft's next forward to run (launched ahead, spec_decode/draft_model.py). So in a closed
batch of plain greedy sequences (nobody waiting to join, every sequence decoding) the engine
plans the next step right after the read (SpeculationDriver.launch_ahead with plans_ahead),
launches the draft's proposals for it, and then launches the next verification pass as well,
fed with those proposals on the device. The host's work for this step then runs while the GPU
drafts and verifies the next one, and the next step only reads the result.

What the pass was built for is checked before it is used: every scheduled sequence one of those
it verified, at the length it was built for, decoding one token, with the planned number of
proposals, taken from that very launch (Proposer.took_ahead), and its block table unchanged.
Sequences that finished or were aborted in between are simply not read; anything else (a new
sequence, a preemption, another plan) makes the step verify as usual, and the pass launched
ahead is wasted work on the device, never a different result: it only ever computes what the
step would have computed, in the same kind of pass.

The same serves plain greedy decoding (LLMEngine.decode_ahead_enabled, on by default on CUDA:
on the H200 it made batch-32 plain decoding 1.20x faster): the next one-token pass of every
sequence is launched right after a step's tokens are read, with no proposals; in a draft model's
closed batch that happens when the next step is planned to decode plainly
(SpeculationDriver.plan_after_plain, or launch_ahead after a verification).

KV slots: the pass writes the KV of each sequence's last token and its proposals, so its
blocks are grown for them when it is launched, and the step's rollback keeps them
(``keep_slots``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from specserve.engine.block_manager import BlockManager
from specserve.engine.scheduler import ScheduledSequence
from specserve.worker.model_runner import ModelRunner, SequenceRun
from specserve.worker.transfer import index_tensor


@dataclass
class VerifyAhead:
    """A verification pass launched ahead, and what it was built for (per seq_id)."""

    lengths: dict[int, int]  # the sequence's length once the last step is committed
    ks: dict[int, int]  # proposals it verifies
    tables: dict[int, list[int]]  # the block-table prefix it wrote and read
    value_start: dict[int, int]  # where its proposals start in values
    row_start: dict[int, int]  # its first row in tokens
    values: torch.Tensor  # [P] int64: the proposals fed, on the device
    tokens: torch.Tensor  # [R] int64: the pass's argmax per row, on the device

    def keep_slots(self, seq_id: int) -> int:
        """KV slots of this sequence the pass uses (0 if it is not in the pass)."""
        return self.lengths.get(seq_id, 0) + self.ks.get(seq_id, 0)


def launch(runner: ModelRunner, block_manager: BlockManager,
           sampled: list[ScheduledSequence], emitted: list[list[int]], plan: dict[int, int],
           launched: torch.Tensor | None,
           last_on_device: torch.Tensor | None = None) -> VerifyAhead | None:
    """Launch the verification of the next step: the last token of each sampled sequence in
    plan (those that may still generate) once emitted[i] is committed, plus plan[seq_id]
    proposals taken from launched ([A, K]: the draft's proposals launched ahead, one row per
    sequence with a proposal, in order). A sequence that ends with this step (max_tokens, the
    context's end) is not in plan: its last token is never fed. None (nothing launched) if a
    sequence's KV blocks cannot grow. launched is None when no sequence proposes (a plain
    greedy decode pass launched ahead: LLMEngine.decode_ahead_enabled).

    last_on_device: this step's tokens [len(sampled)] still on the device, one per sampled
    sequence (a plain step, not read yet: emitted[i] is then a placeholder of one token): each
    run's last token is fed from there, so the pass is queued before the step's read."""
    width = 0 if launched is None else launched.shape[1]
    runs: list[SequenceRun] = []
    rows: list[int] = []  # packed input rows of the proposals
    src: list[int] = []  # their flat index in launched
    last_rows: list[int] = []  # with last_on_device: each run's first row ...
    last_src: list[int] = []  # ... and its sequence's index in last_on_device
    lengths, ks, tables, value_start, row_start = {}, {}, {}, {}, {}
    offset = launched_row = 0
    for i, (s, tokens) in enumerate(zip(sampled, emitted, strict=True)):
        seq, k = s.seq, plan.get(s.seq.seq_id)
        if k is None:
            continue
        length = seq.num_tokens + len(tokens)
        if not block_manager.can_grow(seq, length + k):
            return None  # (the step's rollback gives back what was grown)
        block_manager.grow(seq, length + k)
        runs.append(SequenceRun([tokens[-1]] + [0] * k, length - 1, seq.block_table,
                                list(range(k + 1))))
        last_rows.append(offset)
        last_src.append(i)
        lengths[seq.seq_id], ks[seq.seq_id] = length, k
        tables[seq.seq_id] = seq.block_table[: block_manager.blocks_needed(length + k)]
        row_start[seq.seq_id] = offset
        if k:
            value_start[seq.seq_id] = len(src)
            rows.extend(range(offset + 1, offset + 1 + k))
            src.extend(range(launched_row * width, launched_row * width + k))
            launched_row += 1
        offset += k + 1
    if not runs:
        return None
    device = runner.device
    values = (torch.empty(0, dtype=torch.int64, device=device) if launched is None
              else launched.flatten()[index_tensor(src, device)])  # [P]
    fed = (index_tensor(rows, device), values) if rows else None
    if last_on_device is not None:
        last = last_on_device[index_tensor(last_src, device)]  # [len(runs)]
        fed = ((index_tensor(last_rows, device), last) if fed is None else
               (torch.cat([index_tensor(last_rows, device), fed[0]]), torch.cat([last, values])))
    tokens = runner.execute_argmax_device(runs, fed=fed)  # [R]
    return VerifyAhead(lengths, ks, tables, value_start, row_start, values, tokens)


def take(ahead: VerifyAhead, scheduled: list[ScheduledSequence],
         proposals: list[list[int]], took_launched: bool) -> list[int] | None:
    """The argmax tokens of the rows of this step's verification ([last] + proposals of each
    scheduled sequence, in order) from the pass launched ahead, with the proposals' values
    filled in (the step's one read), if the pass is this step's (module docstring); else
    None. scheduled: the step's sequences, every one sampled (proposals: one list each)."""
    if not serves(ahead, scheduled, proposals, took_launched):
        return None
    return read(ahead, scheduled, proposals)


def serves(ahead: VerifyAhead, scheduled: list[ScheduledSequence],
           proposals: list[list[int]], took_launched: bool) -> bool:
    """Whether the pass launched ahead is this step's (module docstring); host data only."""
    if not took_launched or len(scheduled) != len(proposals):
        return False
    for s, props in zip(scheduled, proposals, strict=True):
        seq_id, seq = s.seq.seq_id, s.seq
        if (ahead.ks.get(seq_id) != len(props) or s.num_new_tokens != 1
                or seq.num_tokens != ahead.lengths[seq_id]
                or seq.block_table[: len(ahead.tables[seq_id])] != ahead.tables[seq_id]):
            return False
    return True


def last_tokens(ahead: VerifyAhead, scheduled: list[ScheduledSequence]) -> torch.Tensor:
    """The device tokens [len(scheduled)] of a plain pass launched ahead that serves this
    step, one per scheduled sequence (its one row), in order, without reading them."""
    rows = [ahead.row_start[s.seq.seq_id] for s in scheduled]
    return ahead.tokens[index_tensor(rows, ahead.tokens.device)]


def read(ahead: VerifyAhead, scheduled: list[ScheduledSequence],
         proposals: list[list[int]]) -> list[int]:
    """take's read, for a pass known to serve the step (serves)."""
    both = torch.cat([ahead.values, ahead.tokens]).tolist()  # the step's one read
    values, tokens = both[: ahead.values.numel()], both[ahead.values.numel():]
    row_tokens: list[int] = []
    for s, props in zip(scheduled, proposals, strict=True):
        seq_id, k = s.seq.seq_id, len(props)
        if k:
            start = ahead.value_start[seq_id]
            props[:] = values[start : start + k]
        row = ahead.row_start[seq_id]
        row_tokens.extend(tokens[row : row + k + 1])
    return row_tokens
