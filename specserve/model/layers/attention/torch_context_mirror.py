"""Contiguous copies of a decode batch's K/V context, kept from one decode step to the next.

Why: the torch backend reads the paged cache by gathering every sequence's blocks into a padded
``[S, K, KvH, D]`` tensor, in every layer of every step. At batch 32 that gather (scattered
blocks, cold again after 540 MB of weights streamed through the caches) costs as much as the
attention itself. During decoding the batch is the same from one step to the next with each
sequence a few tokens further (one for a plain decode, k + 1 for a verification, fewer after
rejected proposals are rolled back), so the gathered context can be kept and each step's new
K/V rows written into it instead of gathering it again.

The mirror is a pure cache of the paged KV cache: a step *extends* it when the batch is the
mirrored one (same sequences in the same rows, each step's run starting at or before the end of
what the mirror holds for its row, the same blocks under the part it reads); any other short-run
step rebuilds it from the paged cache (a sequence joined or left, a block table changed, the
context outgrew the capacity). Long runs (prompts) invalidate it, and it is not used when it
would need more than ``MAX_MIRROR_FRACTION`` of the paged cache's memory.
Rows past a rollback may hold K/V of rejected tokens: they are never read (the mask stops at
each sequence's length) and the next step that reaches them writes them again.
CPU only: on an accelerator that memory would sit outside the KV cache budget (and the gather is
cheap there anyway).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from specserve.model.layers.attention.metadata import AttentionMetadata

# Capacity past the longest context at a rebuild: the mirror is re-gathered once every
# HEADROOM_BLOCKS * block_size steps instead of every step.
HEADROOM_BLOCKS = 4
# The mirror (all layers) may hold at most this fraction of the paged cache's token capacity.
MAX_MIRROR_FRACTION = 0.5
# Steps whose query runs are all at most this long use the mirror (decode, verification);
# longer runs are prompt chunks, which the mirror does not follow.
MAX_MIRROR_QUERY = 16


def _cdiv(a: int, b: int) -> int:
    return (a + b - 1) // b


@dataclass
class MirrorStep:
    """What one decode step does with the mirror, shared by all layers."""

    mirror: ContextMirror
    extend: bool  # True: write this step's K/V rows; False: rebuild from the paged cache
    index: torch.Tensor  # extend: [T] flat row of each new token; rebuild: [S * blocks] ids
    rows: int  # S
    capacity: int  # tokens per mirrored sequence

    def write(self, key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor) -> None:
        """key/value [T, KvH, D]: this step's new tokens (written on extend steps only)."""
        rows = self.extend_rows(k_cache)
        if rows is not None:
            k_rows, v_rows, index = rows
            k_rows.index_copy_(0, index, key)
            v_rows.index_copy_(0, index, value)

    def extend_rows(self, k_cache: torch.Tensor) -> tuple[torch.Tensor, ...] | None:
        """Where this step's new K/V rows go on an extend step: (k rows, v rows [S * capacity,
        KvH, D] views of the layer's buffers, index [T]); None on a rebuild step (which
        gathers the context from the cache after the write)."""
        if not self.extend:
            return None
        mk, mv = self.mirror.buffers(k_cache, self.rows, self.capacity)
        return mk.view(-1, *mk.shape[2:]), mv.view(-1, *mv.shape[2:]), self.index

    def context(self, k_cache: torch.Tensor, v_cache: torch.Tensor,
                max_k: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The layer's K and V for keys [0, max_k): [S, KvH, K, D] strided views."""
        mk, mv = self.mirror.buffers(k_cache, self.rows, self.capacity)
        if not self.extend:  # the cache already holds this step's K/V (written first)
            block = k_cache.shape[1]
            torch.index_select(k_cache, 0, self.index, out=mk.view(-1, block, *mk.shape[2:]))
            torch.index_select(v_cache, 0, self.index, out=mv.view(-1, block, *mv.shape[2:]))
        return mk[:, :max_k].transpose(1, 2), mv[:, :max_k].transpose(1, 2)


class ContextMirror:
    """One per attention backend (so per model runner); buffers keyed by each layer's cache."""

    def __init__(self) -> None:
        self.cache_tokens = 0  # token capacity of one layer's paged cache; 0 until known
        self._seq_lens: list[int] = []  # context lengths the mirror holds (empty: invalid)
        self._tables: torch.Tensor | None = None  # [S, W] block tables it was built from
        self._capacity = 0
        self._buffers: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def invalidate(self) -> None:
        self._seq_lens, self._tables = [], None

    def plan(self, meta: AttentionMetadata) -> MirrorStep | None:
        """Decide this step: extend the mirror, rebuild it, or (None) do without."""
        if meta.block_tables.device.type != "cpu":
            return None  # on accelerators its memory would be outside the KV cache budget
        if meta.max_query_len > MAX_MIRROR_QUERY:
            self.invalidate()  # a prompt chunk: the mirror does not follow it
            return None
        bs, rows = meta.block_size, meta.num_seqs
        needed = _cdiv(meta.max_seq_len, bs)
        starts = [s - q for s, q in zip(meta.seq_lens_host, meta.query_lens, strict=True)]
        extend = self._extends(meta, starts) and needed * bs <= self._capacity
        if not extend:
            capacity = (needed + HEADROOM_BLOCKS) * bs
            if rows * capacity > MAX_MIRROR_FRACTION * self.cache_tokens:
                self.invalidate()
                return None
            self._capacity = capacity
        self._seq_lens, self._tables = list(meta.seq_lens_host), meta.block_tables
        device = meta.block_tables.device
        if extend and meta.max_query_len == 1:  # plain decode: one new row per sequence
            rows_idx = torch.arange(rows, device=device) * self._capacity  # [S]
            index = rows_idx + meta.seq_lens.to(torch.int64) - 1  # [S]
        elif extend:  # runs of several tokens: row i's tokens go to positions starts[i]..
            query_lens = torch.tensor(meta.query_lens, device=device)  # [S]
            seq_of_token = torch.repeat_interleave(torch.arange(rows, device=device),
                                                   query_lens)  # [T]
            run_start = meta.query_start_loc[:-1].to(torch.int64)[seq_of_token]  # [T]
            position = (torch.tensor(starts, device=device)[seq_of_token]
                        + torch.arange(meta.num_tokens, device=device) - run_start)  # [T]
            index = seq_of_token * self._capacity + position  # [T]
        else:
            cap_blocks = self._capacity // bs
            tables = meta.block_tables[:, :cap_blocks].to(torch.int64)  # [S, <= cap_blocks]
            index = torch.nn.functional.pad(tables, (0, cap_blocks - tables.shape[1]))
            index = index.reshape(-1)  # [S * cap_blocks]; padding reads block 0 (masked)
        return MirrorStep(self, extend, index, rows, self._capacity)

    def _extends(self, meta: AttentionMetadata, starts: list[int]) -> bool:
        """True when this batch is the mirrored one: every run starts at or before the end of
        what the mirror holds for its row (after a plain decode exactly there; after a
        verification whose proposals were rejected, before it), and the blocks under the
        positions read from the mirror (before the run) are still the ones it was built from.

        Another sequence cannot pass for the mirrored one: it would have had to compute its
        prompt in a step that invalidated or rebuilt the mirror, unless its prompt came from
        the prefix cache, and then the blocks it shares hold exactly the same keys/values."""
        prev = self._seq_lens
        if not prev or len(prev) != meta.num_seqs or self._tables is None:
            return False
        if any(start > old for start, old in zip(starts, prev, strict=True)):
            return False
        bs = meta.block_size
        held = torch.tensor([_cdiv(n, bs) for n in starts])  # [S] blocks read from the mirror
        width = int(held.max())
        if meta.block_tables.shape[1] < width or self._tables.shape[1] < width:
            return False
        same = meta.block_tables[:, :width] == self._tables[:, :width]  # [S, W]
        beyond = torch.arange(width)[None, :] >= held[:, None]  # [S, W]: not read there
        return bool((same | beyond).all())

    def buffers(self, k_cache: torch.Tensor, rows: int,
                capacity: int) -> tuple[torch.Tensor, torch.Tensor]:
        """This layer's (K, V) mirror, [rows, capacity, KvH, D] each, (re)allocated on demand."""
        key = k_cache.data_ptr()
        shape = (rows, capacity, *k_cache.shape[2:])
        held = self._buffers.get(key)
        if held is None or held[0].shape != shape:
            held = self._buffers[key] = (k_cache.new_empty(shape), k_cache.new_empty(shape))
        return held
