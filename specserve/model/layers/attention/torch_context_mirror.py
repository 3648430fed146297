"""Contiguous copies of a decode batch's K/V context, kept from one decode step to the next.

Why: the torch backend reads the paged cache by gathering every sequence's blocks into a padded
``[S, K, KvH, D]`` tensor, in every layer of every step. At batch 32 that gather (scattered
blocks, cold again after 540 MB of weights streamed through the caches) costs as much as the
attention itself. During decoding the batch is the same from one step to the next with each
sequence a few tokens further (one for a plain decode, k + 1 for a verification, fewer after
rejected proposals are rolled back), so the gathered context can be kept and each step's new
K/V rows written into it instead of gathering it again.

The mirror is a pure cache of the paged KV cache: a step *extends* it when every row of the
batch has a row of the mirror that holds its context (each step's run starting at or before the
end of what that row holds, the same blocks under the part it reads), matched in order; any
other short-run step rebuilds it from the paged cache (a sequence joined, a block table changed,
the context outgrew the capacity). When sequences left the batch (they finish at different
steps, the more so with speculation), the kept rows are compacted in place instead: rows move
towards a window of the buffers chosen so that as few tokens as possible move, which costs a
fraction of re-gathering every row from scattered blocks. Long runs (prompts) invalidate it, and
it is not used when it would need more than ``MAX_MIRROR_FRACTION`` of the paged cache's memory.
Rows past a rollback may hold K/V of rejected tokens: they are never read (the mask stops at
each sequence's length) and the next step that reaches them writes them again.
CPU only: on an accelerator that memory would sit outside the KV cache budget (and the gather is
cheap there anyway).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

import torch

from specserve.model.layers.attention.metadata import AttentionMetadata

# Capacity past the longest context at a rebuild: the mirror is re-gathered once every
# HEADROOM_BLOCKS * block_size steps instead of every step.
HEADROOM_BLOCKS = 4
# The mirror (all layers) may hold at most this fraction of the paged cache's token capacity.
# Why as much as the cache itself: the mirror needs batch x (longest context + headroom) rows,
# and at 0.5 of the CPU's default 1 GB cache (23,296 SmolLM2 tokens) a batch of 32 lost it once
# its longest context passed ~290 tokens, so 32 code-edit prompts of 94-334 tokens gathered
# every block in every layer of every decode step (index_select: ~64 ms of a ~150 ms step).
# At 1.0 their 127 decode steps took 12.4-13.8 s instead of 17.5 s (session 39). The reserve
# is virtual until a rebuild touches it, so a process pays only for the rows it uses.
MAX_MIRROR_FRACTION = 1.0
# Steps whose query runs are all at most this long use the mirror (decode, verification);
# longer runs are prompt chunks, which the mirror does not follow.
MAX_MIRROR_QUERY = 16
# A batch that lost rows is compacted in place rather than rebuilt (False: always rebuild; kept
# as a switch for A/B measurements).
COMPACT_SHRUNK_BATCHES = True


def _cdiv(a: int, b: int) -> int:
    return (a + b - 1) // b


def _host_tables(meta: AttentionMetadata) -> list[list[int]]:
    """The step's block tables as host lists (the runner passes them; else read once)."""
    if meta.block_tables_host is not None:
        return meta.block_tables_host
    return meta.block_tables.tolist()


# (source slot, destination slot, tokens): one row's context moved inside a layer's buffers
Move = tuple[int, int, int]


@dataclass
class _LayerBuffers:
    """One layer's mirror: K and V [slots, capacity, KvH, D], of which a step uses the rows
    [base, base + S). Slots may outnumber the batch: a shrunk batch keeps its allocation.

    They are views of storage reserved once per layer for the largest mirror the budget allows
    (MAX_MIRROR_FRACTION of the layer's cache), not allocated per rebuild: memory a process
    has never touched costs nothing until it is, while a fresh allocation at every rebuild
    (the batch's context outgrowing the capacity, every HEADROOM_BLOCKS blocks) made the
    rebuild fault in every page again. At batch 32 with SmolLM2 (30 layers, ~280 MB of
    mirror) such a rebuild took 400-440 ms in some runs, ten decode steps, against ~45 ms
    when the memory was already mapped. The storage is not filled when it is reserved: each
    page is faulted in once, by the first rebuild that reaches it, so a process that only
    ever decodes short contexts at small batches never maps the rest (zero-filling all of
    it, 512 MB by default, cost a one-prompt `specserve generate` ~0.2 s and every process
    that much memory)."""

    k_storage: torch.Tensor  # [reserved elements]
    v_storage: torch.Tensor
    k: torch.Tensor  # [slots, capacity, KvH, D] view of k_storage
    v: torch.Tensor
    version: int  # the arrangement of rows they hold (see ContextMirror.plan)
    # The last rows() answer, kept while the step's window of rows is the same: (base, count)
    # -> views. Slicing, flattening and transposing them anew took ~2 us per view, in each of
    # SmolLM2's 30 layers every step.
    _window: tuple[int, int] | None = None
    _views: tuple[torch.Tensor, ...] = ()

    def shape_as(self, shape: tuple[int, ...]) -> None:
        """View the storage as K and V buffers of this shape (the contents are not kept)."""
        count = shape[0] * shape[1] * shape[2] * shape[3]
        self.k = self.k_storage[:count].view(shape)
        self.v = self.v_storage[:count].view(shape)
        self._window = None

    def rows(self, base: int, count: int) -> tuple[torch.Tensor, ...]:
        """Views of the rows [base, base + count): K, V [S, capacity, KvH, D]; the same
        flattened, [S * capacity, KvH, D] (where a step writes its tokens); the same as the
        attention kernel reads them, [S, KvH, capacity, D]."""
        if self._window != (base, count):
            k, v = self.k[base : base + count], self.v[base : base + count]
            self._views = (k, v, k.view(-1, *k.shape[2:]), v.view(-1, *v.shape[2:]),
                           k.transpose(1, 2), v.transpose(1, 2))
            self._window = (base, count)
        return self._views


@dataclass
class MirrorStep:
    """What one decode step does with the mirror, shared by all layers."""

    mirror: ContextMirror
    extend: bool  # True: write this step's K/V rows; False: rebuild from the paged cache
    index: torch.Tensor  # extend: [T] flat row of each new token; rebuild: [S * blocks] ids
    rows: int  # S
    capacity: int  # tokens per mirrored sequence
    base: int = 0  # slot of the batch's first row in the layers' buffers
    version: int = 0  # the arrangement of rows this step reads
    # Compaction that brings a layer from version - 1 to version, applied in each layer's first
    # call of the step (the plan is made once per step, the buffers are per layer).
    moves: list[Move] = field(default_factory=list)
    # layer's cache pointer -> its views for this step (_LayerBuffers.rows): an extend step
    # asks twice per layer (write, then read), and even a kept view costs more than a probe
    _views: dict[int, tuple[torch.Tensor, ...]] = field(default_factory=dict)

    def buffers(self, k_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """This layer's (K, V) mirror rows, [S, capacity, KvH, D] each."""
        return self._layer_views(k_cache)[:2]

    def _layer_views(self, k_cache: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """_LayerBuffers.rows() of this layer for the step."""
        views = self._views.get(k_cache.data_ptr())
        if views is None:
            views = self._views[k_cache.data_ptr()] = self.mirror.buffers(k_cache, self)
        return views

    def kernel_views(self, k_cache: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """An extend step's views for the C++ kernels: K and V rows [S * capacity, KvH, D]
        (where rope_write_kv writes the step's tokens, at self.index), then K and V
        [S, KvH, capacity, D] (what run_attention reads, up to each sequence's length: the
        same keys as context(), whose views stop at max_k)."""
        return self._layer_views(k_cache)[2:]

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
        k_rows, v_rows, _, _ = self.kernel_views(k_cache)
        return k_rows, v_rows, self.index

    def context(self, k_cache: torch.Tensor, v_cache: torch.Tensor,
                max_k: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The layer's K and V for keys [0, max_k): [S, KvH, K, D] strided views."""
        mk, mv = self.buffers(k_cache)
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
        # the block tables it was built from (host copies, one list per row)
        self._tables: list[list[int]] | None = None
        self._capacity = 0
        self._base = 0  # slot of row 0
        self._version = 0  # bumped by every rebuild and every compaction that moves rows
        self._buffers: dict[int, _LayerBuffers] = {}
        # Steps that rebuilt the mirror, compacted it, or extended it as it was (benchmarks
        # read these to see what batch changes cost).
        self.counts: Counter[str] = Counter()

    def invalidate(self) -> None:
        self._seq_lens, self._tables = [], None

    def plan(self, meta: AttentionMetadata) -> MirrorStep | None:
        """Decide this step: extend the mirror (compacting it first if rows left), rebuild
        it, or (None) do without."""
        if meta.block_tables.device.type != "cpu":
            return None  # on accelerators its memory would be outside the KV cache budget
        if meta.max_query_len > MAX_MIRROR_QUERY:
            self.invalidate()  # a prompt chunk: the mirror does not follow it
            return None
        bs, rows = meta.block_size, meta.num_seqs
        needed = _cdiv(meta.max_seq_len, bs)
        starts = [s - q for s, q in zip(meta.seq_lens_host, meta.query_lens, strict=True)]
        tables = _host_tables(meta)
        sources = (self._match(meta, starts, tables) if needed * bs <= self._capacity
                   else None)
        moves: list[Move] = []
        if sources is not None and rows == len(self._seq_lens):
            self.counts["extend"] += 1  # every row is its own: nothing moves
        elif sources is not None:
            self._base, moves = self._compaction(sources, starts)
            if moves:
                self._version += 1
            self.counts["compact"] += 1
            self.counts["moved rows"] += len(moves)
        else:
            capacity = (needed + HEADROOM_BLOCKS) * bs
            if rows * capacity > MAX_MIRROR_FRACTION * self.cache_tokens:
                self.invalidate()
                return None
            self._capacity, self._base = capacity, 0
            self._version += 1
            self.counts["rebuild"] += 1
        self._seq_lens = list(meta.seq_lens_host)
        # copies: the callers' lists may be the block manager's, which change in place
        self._tables = [list(row) for row in tables]
        extend = sources is not None
        index = (self._extend_index(meta, starts) if extend
                 else self._gather_index(meta))
        return MirrorStep(self, extend, index, rows, self._capacity, self._base,
                          self._version, moves)

    def _extend_index(self, meta: AttentionMetadata, starts: list[int]) -> torch.Tensor:
        """[T] int64: the row of this step's tokens in the batch's [S * capacity] buffer rows:
        row i's tokens go to positions starts[i].. of its row. Built on the host (a handful of
        small torch ops cost ~75 us at one row, ~220 us for a verification, on every step)."""
        cap = self._capacity
        index = [i * cap + p for i, (start, q) in enumerate(zip(starts, meta.query_lens,
                                                                 strict=True))
                 for p in range(start, start + q)]
        return torch.tensor(index, dtype=torch.int64)  # [T]

    def _gather_index(self, meta: AttentionMetadata) -> torch.Tensor:
        """[S * capacity blocks] int64: the blocks a rebuild gathers, row after row."""
        cap_blocks = self._capacity // meta.block_size
        tables = meta.block_tables[:, :cap_blocks].to(torch.int64)  # [S, <= cap_blocks]
        index = torch.nn.functional.pad(tables, (0, cap_blocks - tables.shape[1]))
        return index.reshape(-1)  # [S * cap_blocks]; padding reads block 0 (masked)

    def _match(self, meta: AttentionMetadata, starts: list[int],
               new: list[list[int]]) -> list[int] | None:
        """For each row of this batch, the mirror row that holds its context, in order (a
        shrunk batch keeps its rows' order: the scheduler removes finished sequences from its
        running list and appends new ones); None when some row has none. new: this step's
        block tables (host lists, _host_tables).

        Row i may take mirror row j when its run starts at or before the end of what row j
        holds (after a plain decode exactly there; after a verification whose proposals were
        rejected, before it) and the blocks under the positions read from the mirror (before
        the run) are still the ones row j was built from. Another sequence cannot pass for the
        mirrored one: it would have had to compute its prompt in a step that invalidated or
        rebuilt the mirror, unless its prompt came from the prefix cache, and then the blocks
        it shares hold exactly the same keys/values."""
        prev = self._seq_lens
        if not prev or self._tables is None or meta.num_seqs > len(prev):
            return None
        if meta.num_seqs < len(prev) and not COMPACT_SHRUNK_BATCHES:
            return None
        bs = meta.block_size
        held = [_cdiv(n, bs) for n in starts]  # blocks read from the mirror, per row
        old = self._tables
        sources, j = [], 0
        # (a batch of the mirror's size matches only row for row: a skipped row leaves too few)
        for i, (start, n) in enumerate(zip(starts, held, strict=True)):
            # the first fitting row is never worse: it leaves the most rows for the rest
            while j < len(prev) and not (start <= prev[j] and new[i][:n] == old[j][:n]):
                j += 1
            if j == len(prev):
                return None
            sources.append(j)
            j += 1
        return sources

    def _compaction(self, sources: list[int], starts: list[int]) -> tuple[int, list[Move]]:
        """The new base slot and the moves that put mirror row sources[i] at slot base + i.

        Row i's slot shifts by old slot - i; the base is the shift that keeps the most tokens
        in place (a sequence leaving near the top shifts the rows above it instead of all those
        below). Only the positions before each run move (the step writes the rest). Order:
        rows moving down, lowest first, then rows moving up, highest first; since the shift
        grows with i, no row is overwritten before it has moved."""
        slots = [self._base + j for j in sources]  # [S] current slot of each batch row
        kept: Counter[int] = Counter()
        for i, (slot, start) in enumerate(zip(slots, starts, strict=True)):
            kept[slot - i] += start
        base = max(kept, key=kept.__getitem__)
        moving = [(slot, base + i, n) for i, (slot, n) in enumerate(zip(slots, starts,
                                                                         strict=True))
                  if slot != base + i and n > 0]
        down = [move for move in moving if move[0] > move[1]]
        up = [move for move in moving if move[0] < move[1]]
        return base, down + up[::-1]

    def buffers(self, k_cache: torch.Tensor,
                step: MirrorStep) -> tuple[torch.Tensor, ...]:
        """This layer's mirror rows for the step (_LayerBuffers.rows: K and V [S, capacity,
        KvH, D] first): on a rebuild (re)allocated as needed, on an extend compacted once if
        the step moves rows."""
        key = k_cache.data_ptr()
        held = self._buffers.get(key)
        if not step.extend:
            shape = (step.capacity, *k_cache.shape[2:])
            full = (step.rows, *shape)
            count = step.rows * step.capacity * k_cache.shape[2] * k_cache.shape[3]
            if (held is None or held.k_storage.numel() < count
                    or held.k.dtype != k_cache.dtype):
                budget = int(MAX_MIRROR_FRACTION * k_cache.shape[0] * k_cache.shape[1])
                reserve = max(count, budget * k_cache.shape[2] * k_cache.shape[3])
                held = self._buffers[key] = _LayerBuffers(  # mapped as used (see above)
                    k_cache.new_empty(reserve), k_cache.new_empty(reserve),
                    k_cache.new_empty(0), k_cache.new_empty(0), step.version)
            if held.k.shape[1:] != shape or held.k.shape[0] < step.rows:
                held.shape_as(full)
            held.version = step.version
        elif held is None or held.version != step.version:
            assert held is not None, "an extend step reached a layer the mirror never built"
            assert held.version == step.version - 1 and step.moves, "a layer missed a step"
            for src, dst, n in step.moves:
                held.k[dst, :n].copy_(held.k[src, :n])
                held.v[dst, :n].copy_(held.v[src, :n])
            held.version = step.version
        return held.rows(step.base, step.rows)
