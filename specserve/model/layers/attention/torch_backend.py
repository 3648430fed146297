"""Reference attention in plain torch: read each sequence's KV through its block table.

One SDPA call per layer serves the whole batch. ``prepare`` looks at the batch once per step
and picks the cheapest layout that is exact for it, so the per-layer work is a couple of
gathers and one kernel, with every index and mask built once and shared by all layers:

* ``_DecodeLayout`` - every query run is one token (plain decoding, the common case). Queries
  need no gather ([T, H, D] already is [S, H, D]); grouped-query heads are folded into the
  query-length axis ([S, KvH, G, D]) so no key/value head is ever repeated; the context comes
  from a ``ContextMirror`` kept across decode steps (grown by one row per sequence per step)
  or, when that does not apply, from a whole-block gather; ragged context lengths cost one
  additive mask row per sequence and equal ones need no mask at all.
* ``_PrefillLayout`` - every run is a whole prompt starting at position 0, so the context is
  exactly the run itself: keys/values come from this step's own slots and ``is_causal`` replaces
  the [S, Q, K] mask (SDPA then also skips the masked half of the work).
* ``_MixedLayout`` - anything else (prefill chunks over a cached prefix, multi-token
  verification, mixed batches): a padded ``[num_seqs, max_query_len]`` x
  ``[num_seqs, max_seq_len]`` batch with one precomputed additive mask. Verification steps
  (short runs) read their context from the same mirror as decode steps, so switching between
  speculative and plain steps keeps it instead of re-gathering it twice.
* ``_SplitLayout`` - mostly one-token runs with a few longer ones (a large batch in which only
  some sequences verify proposals, or decodes beside a prompt chunk), where padding every run
  to the longest would multiply the attention work: every run's last query goes through the
  decode layout's computation, and only the longer runs' other queries are attended, one
  sequence at a time, against views of that sequence's context.

Padding is cheap at CPU batch sizes and keeps the number of ops per layer constant, which
matters more on CPU (30 layers x per-op dispatch) than the wasted FLOPs.

On float32 CPU tensors with the C++ kernels built, every step goes instead to
``_KernelRunsLayout`` (csrc/attention.cpp), which computes each query row the same way in any
step; the layouts above serve other dtypes and devices, and that layout's fallbacks.
"""

from __future__ import annotations

import sys
from abc import ABC, abstractmethod
from collections.abc import Callable

import torch
import torch.nn.functional as F

from specserve.model.layers import cpu_kernels
from specserve.model.layers.attention.backend import AttentionBackend
from specserve.model.layers.attention.metadata import AttentionMetadata
from specserve.model.layers.attention.torch_context_mirror import ContextMirror, MirrorStep

NEG_INF = float("-inf")


def _gather_blocks(cache: torch.Tensor, block_ids: torch.Tensor, num_seqs: int,
                   max_k: int) -> torch.Tensor:
    """cache [N, bs, KvH, D], block_ids [S * nb] -> [S, KvH, max_k, D] (a strided view of one
    copy). Whole-block index_select copies bs * KvH * D contiguous floats per index, several
    times faster than gathering slot by slot."""
    blocks = cache.index_select(0, block_ids)  # [S * nb, bs, KvH, D]
    kv_heads, head_dim = cache.shape[2], cache.shape[3]
    return blocks.view(num_seqs, -1, kv_heads, head_dim)[:, :max_k].transpose(1, 2)


class _AdditiveMask:
    """A boolean "may attend" mask turned into SDPA's additive form once per step and dtype.

    Additive because SDPA would otherwise convert a boolean mask in every layer; built lazily
    because the mask must match the query dtype, which only the layers know."""

    def __init__(self, allowed: torch.Tensor) -> None:
        self.allowed = allowed
        self._additive: dict[torch.dtype, torch.Tensor] = {}

    def get(self, dtype: torch.dtype) -> torch.Tensor:
        mask = self._additive.get(dtype)
        if mask is None:
            mask = torch.zeros(self.allowed.shape, dtype=dtype, device=self.allowed.device)
            mask = self._additive[dtype] = mask.masked_fill_(~self.allowed, NEG_INF)
        return mask


class _Layout(ABC):
    """Per-step indices and masks for one batch shape; `attend` runs once per layer."""

    def wrote_kv(self, key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor) -> None:
        """Called once per layer after this step's K/V ([T, KvH, D]) reached the paged cache;
        only layouts that keep state across steps care."""
        return None

    def extra_kv_rows(self, k_cache: torch.Tensor) -> tuple[torch.Tensor, ...] | None:
        """Further (k rows, v rows, index) this step's K/V must also be written to, for a
        kernel that writes them itself instead of calling wrote_kv; None if there are none."""
        return None

    @abstractmethod
    def attend(self, query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
               scale: float) -> torch.Tensor:
        """query [T, H, D], caches [N, bs, KvH, D] -> [T, H, D]."""


def _block_ids(meta: AttentionMetadata) -> torch.Tensor:
    """[S * nb] int64: the blocks covering each sequence's first max_seq_len slots."""
    num_blocks = (meta.max_seq_len + meta.block_size - 1) // meta.block_size
    return meta.block_tables[:, :num_blocks].reshape(-1).to(torch.int64)


class _ContextLayout(_Layout):
    """A layout whose queries read each sequence's context [0, max_seq_len) from the paged
    cache: through the step's mirror when it has one, else by gathering whole blocks."""

    def __init__(self, meta: AttentionMetadata, mirror: MirrorStep | None) -> None:
        self.max_k = meta.max_seq_len
        self.mirror = mirror  # None: gather the context from the paged cache in every layer
        self.block_ids = _block_ids(meta) if mirror is None else None  # [S * nb]

    def wrote_kv(self, key, value, k_cache):
        if self.mirror is not None:
            self.mirror.write(key, value, k_cache)

    def extra_kv_rows(self, k_cache):
        return None if self.mirror is None else self.mirror.extend_rows(k_cache)

    def context(self, k_cache: torch.Tensor, v_cache: torch.Tensor,
                num_seqs: int) -> tuple[torch.Tensor, torch.Tensor]:
        """This layer's keys and values, [S, KvH, max_k, D] each."""
        if self.mirror is not None:
            return self.mirror.context(k_cache, v_cache, self.max_k)
        return (_gather_blocks(k_cache, self.block_ids, num_seqs, self.max_k),
                _gather_blocks(v_cache, self.block_ids, num_seqs, self.max_k))


def _context_length_mask(meta: AttentionMetadata, max_k: int) -> _AdditiveMask | None:
    """[S, 1, 1, K] "key < this sequence's length" for one query per sequence over contexts
    gathered to max_k keys; None when every context is exactly max_k long (no mask needed)."""
    if min(meta.seq_lens_host) == max_k:
        return None
    k_pos = torch.arange(max_k, device=meta.seq_lens.device)  # [K]
    allowed = k_pos[None, :] < meta.seq_lens[:, None].to(torch.int64)  # [S, K]
    return _AdditiveMask(allowed[:, None, None, :])


def _attend_one_query_per_sequence(query: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                                   mask: _AdditiveMask | None, scale: float) -> torch.Tensor:
    """query [S, H, D] (one row per sequence) against k, v [S, KvH, K, D] -> [S, H, D].

    The G = H / KvH query heads sharing a KV head become G query rows of that head (HF maps
    query head h to KV head h // G, which is exactly this view): no KV repeat."""
    s, num_heads, head_dim = query.shape
    q = query.reshape(s, k.shape[1], num_heads // k.shape[1], head_dim)  # [S, KvH, G, D]
    attn_mask = None if mask is None else mask.get(query.dtype)
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, scale=scale)
    return out.reshape(s, num_heads, head_dim)  # [S, KvH, G, D] -> [S, H, D]


class _DecodeLayout(_ContextLayout):
    def __init__(self, meta: AttentionMetadata, mirror: MirrorStep | None) -> None:
        super().__init__(meta, mirror)
        self.mask = _context_length_mask(meta, self.max_k)

    def attend(self, query, k_cache, v_cache, scale):
        k, v = self.context(k_cache, v_cache, query.shape[0])  # [S, KvH, K, D] each
        return _attend_one_query_per_sequence(query, k, v, self.mask, scale)  # [T, H, D]


def _padded_query_index(meta: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
    """(index [S, Q] of each padded query row into the flat tokens, padding clamped onto a real
    row; flat index [T] of each real row inside the padded [S * Q] layout)."""
    device = meta.slot_mapping.device
    max_q = meta.max_query_len
    query_lens = torch.tensor(meta.query_lens, dtype=torch.int64, device=device)  # [S]
    starts = meta.query_start_loc[:-1].to(torch.int64)  # [S]
    q_offsets = torch.arange(max_q, device=device)  # [Q]
    q_index = (starts[:, None] + q_offsets[None, :]).clamp(max=meta.num_tokens - 1)  # [S, Q]
    seq_of_token = torch.repeat_interleave(torch.arange(meta.num_seqs, device=device),
                                           query_lens)  # [T]
    offset_in_run = torch.arange(meta.num_tokens, device=device) - starts[seq_of_token]  # [T]
    return q_index, seq_of_token * max_q + offset_in_run


def _unpad(out: torch.Tensor, real_rows: torch.Tensor | None) -> torch.Tensor:
    """SDPA output [S, H, Q, D] -> [T, H, D]: the real query rows, in token order."""
    s, num_heads, max_q, head_dim = out.shape
    flat = out.transpose(1, 2).reshape(s * max_q, num_heads, head_dim)  # [S*Q, H, D]
    return flat if real_rows is None else flat.index_select(0, real_rows)


class _PrefillLayout(_Layout):
    def __init__(self, meta: AttentionMetadata) -> None:
        if meta.num_seqs == 1:
            self.q_index = self.real_rows = None  # the flat tokens already are the one run
            self.kv_slots = meta.slot_mapping[None]  # [1, T]
        else:
            self.q_index, self.real_rows = _padded_query_index(meta)  # [S, Q], [T]
            self.kv_slots = meta.slot_mapping[self.q_index]  # [S, Q]: each run's own slots

    def attend(self, query, k_cache, v_cache, scale):
        # This step wrote the whole context, so reading its own slots back gives the keys and
        # values without touching the rest of the cache.
        flat_k = k_cache.view(-1, *k_cache.shape[2:])  # [N * bs, KvH, D]
        flat_v = v_cache.view(-1, *v_cache.shape[2:])
        q = query[None] if self.q_index is None else query[self.q_index]  # [S, Q, H, D]
        k = flat_k[self.kv_slots].transpose(1, 2)  # [S, KvH, Q, D]
        v = flat_v[self.kv_slots].transpose(1, 2)
        # Runs are left-aligned, so real query row i sees keys 0..i, all of them real; padded
        # rows see finite junk and are dropped by _unpad.
        out = F.scaled_dot_product_attention(q.transpose(1, 2), k, v, is_causal=True,
                                             scale=scale,
                                             enable_gqa=query.shape[1] != k_cache.shape[2])
        return _unpad(out, self.real_rows)  # [T, H, D]


class _MixedLayout(_ContextLayout):
    def __init__(self, meta: AttentionMetadata, mirror: MirrorStep | None) -> None:
        super().__init__(meta, mirror)
        device = meta.slot_mapping.device
        self.q_index, self.real_rows = _padded_query_index(meta)  # [S, Q], [T]
        query_lens = torch.tensor(meta.query_lens, dtype=torch.int64, device=device)  # [S]
        seq_lens = meta.seq_lens.to(torch.int64)  # [S]
        # Absolute position of each query: context before the run plus its offset in the run.
        q_pos = (seq_lens - query_lens)[:, None] + torch.arange(meta.max_query_len,
                                                                device=device)  # [S, Q]
        k_pos = torch.arange(self.max_k, device=device)  # [K]
        allowed = (k_pos[None, None, :] <= q_pos[:, :, None]) & (
            k_pos[None, None, :] < seq_lens[:, None, None]
        )  # [S, Q, K]
        # Padded query rows attend to key 0 so that softmax never sees an all-masked row.
        allowed[:, :, 0] = True
        self.mask = _AdditiveMask(allowed[:, None])  # [S, 1, Q, K]

    def attend(self, query, k_cache, v_cache, scale):
        s = self.q_index.shape[0]
        q = query[self.q_index].transpose(1, 2)  # [S, H, Q, D]
        k, v = self.context(k_cache, v_cache, s)  # [S, KvH, K, D] each
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=self.mask.get(query.dtype),
                                             scale=scale,
                                             enable_gqa=query.shape[1] != k_cache.shape[2])
        return _unpad(out, self.real_rows)  # [T, H, D]


class _SplitLayout(_ContextLayout):
    def __init__(self, meta: AttentionMetadata, mirror: MirrorStep | None) -> None:
        super().__init__(meta, mirror)
        device = meta.slot_mapping.device
        s = meta.num_seqs
        # [S]: each run's last query, which sees the run's whole context, as a decode does
        self.last_rows = meta.query_start_loc[1:].to(torch.int64) - 1
        self.decode_mask = _context_length_mask(meta, self.max_k)
        # The longer runs' other E = q - 1 queries, one sequence at a time: its context is a
        # view of the step's context (no copy), its queries see keys [0, start + e] for the
        # query at offset e, i.e. the first start + E keys with a bottom-right causal mask.
        starts = [0]
        for q in meta.query_lens:
            starts.append(starts[-1] + q)
        self.extras: list[tuple[int, int, int, int, torch.Tensor]] = []
        self._masks: dict[tuple[torch.dtype, int], list[torch.Tensor]] = {}
        source = torch.empty(meta.num_tokens, dtype=torch.int64)  # [T] row of each token in
        source[self.last_rows.cpu()] = torch.arange(s)  # cat([last [S], extras...])
        row = s
        for i, (q, seq_len) in enumerate(zip(meta.query_lens, meta.seq_lens_host, strict=True)):
            if q == 1:
                continue
            e, keys = q - 1, seq_len - 1  # context before the run + the E queries
            allowed = torch.ones(e, keys, dtype=torch.bool).tril_(keys - e)  # [E, keys]
            self.extras.append((i, starts[i], e, keys, allowed.to(device)))
            source[starts[i] : starts[i] + e] = torch.arange(row, row + e)
            row += e
        self.source = source.to(device)

    def attend(self, query, k_cache, v_cache, scale):
        s = self.last_rows.shape[0]
        _, num_heads, head_dim = query.shape
        kv_heads = k_cache.shape[2]
        groups = num_heads // kv_heads
        k, v = self.context(k_cache, v_cache, s)  # [S, KvH, K, D] each
        outs = [_attend_one_query_per_sequence(query.index_select(0, self.last_rows), k, v,
                                               self.decode_mask, scale)]  # [S, H, D]
        masks = self._masks.get((query.dtype, groups))
        if masks is None:  # built once per step: [G * E, keys] additive, rows g-major
            masks = self._masks[(query.dtype, groups)] = [
                _AdditiveMask(allowed.repeat(groups, 1)).get(query.dtype)
                for *_, allowed in self.extras]
        for (i, start, e, keys, _), m in zip(self.extras, masks, strict=True):
            # [E, H, D] -> [KvH, G * E, D] (rows g-major), against [KvH, keys, D] views
            qe = query[start : start + e].view(e, kv_heads, groups, head_dim)
            qe = qe.permute(1, 2, 0, 3).reshape(kv_heads, groups * e, head_dim)
            out = F.scaled_dot_product_attention(qe, k[i, :, :keys], v[i, :, :keys],
                                                 attn_mask=m, scale=scale)
            outs.append(out.view(kv_heads, groups, e, head_dim).permute(2, 0, 1, 3)
                        .reshape(e, num_heads, head_dim))
        return torch.cat(outs).index_select(0, self.source)  # [T, H, D]


KERNEL_HEAD_DIMS = (16, 32, 64, 128)  # head sizes csrc/attention.cpp serves


class _KernelRunsLayout(_ContextLayout):
    """Every step on float32 CPU tensors: csrc/attention.cpp attends every run against its
    context in one call, with no padding, mask or query gather (2.5x faster than SDPA for one
    query per sequence and 1.6x for six on SmolLM2's shapes; 3.5-5x for whole prompts of
    130-2000 tokens). Anything the kernel does not take (another dtype, a head size other than
    16, 32, 64 or 128) goes to the layout prepare() would otherwise have picked, built on first
    use."""

    def __init__(self, meta: AttentionMetadata, mirror: MirrorStep | None, fallback) -> None:
        super().__init__(meta, mirror)
        self.query_start = meta.query_start_loc.to(torch.int64)  # [S + 1]
        self.seq_lens = meta.seq_lens.to(torch.int64)  # [S]
        self._fallback_factory = fallback
        self._fallback: _Layout | None = None

    def attend(self, query, k_cache, v_cache, scale):
        head_dim = query.shape[-1]
        if cpu_kernels.available(query) and head_dim in KERNEL_HEAD_DIMS \
                and k_cache.dtype == torch.float32 and query.stride(-1) == 1:
            k, v = self.context(k_cache, v_cache, self.seq_lens.shape[0])  # [S, KvH, K, D]
            return cpu_kernels.load().run_attention(query, k, v, self.query_start,
                                                    self.seq_lens, scale)  # [T, H, D]
        if self._fallback is None:
            self._fallback = self._fallback_factory()
        return self._fallback.attend(query, k_cache, v_cache, scale)


# Longest query run sent to csrc/attention.cpp: every run (it splits long ones into blocks of
# rows); tests set 0 to exercise the torch layouts on float32 CPU tensors.
MAX_KERNEL_RUN = sys.maxsize


def _padding_dominates(meta: AttentionMetadata) -> bool:
    """Padding every run to the longest would at least double the query rows: then the split
    layout (no padding, one extra attention call per longer run) is the cheaper one."""
    return meta.num_seqs * meta.max_query_len >= 2 * meta.num_tokens


class TorchAttentionBackend(AttentionBackend):
    name = "torch"

    def __init__(self) -> None:
        self.mirror = ContextMirror()  # decode context kept across steps (see its module)
        # per layer (its k_cache's address): see _cache_views
        self._kernel_layers: dict[int, tuple] = {}

    def prepare(self, meta: AttentionMetadata) -> None:
        """Pick this step's layout (the one place that chooses) and precompute it.

        float32 steps on the CPU go to csrc/attention.cpp whatever their runs (decode,
        verification, prompt chunks, whole prompts), so a query row's attention has the same
        bits whichever step computes it: a token verified beside proposals, decoded alone,
        or prefilled in a chunk the lookahead budget cut elsewhere. Models whose projections
        amplify last-bit differences (quantization="gguf_a8" rounds activations to 8 bits)
        then give the same tokens with and without speculation at every batch size. The
        torch layouts below remain the path for other dtypes and devices (and the fallback
        inside _KernelRunsLayout)."""
        whole_prompts = all(q == s for q, s in zip(meta.query_lens, meta.seq_lens_host,
                                                   strict=True))
        if whole_prompts:
            self.mirror.invalidate()  # this step writes K/V the mirror does not follow
            mirror = None
            kind: Callable[[], _Layout] = lambda: _PrefillLayout(meta)  # noqa: E731
        else:
            mirror = self.mirror.plan(meta)
            if meta.max_query_len == 1:
                context_kind: type[_ContextLayout] = _DecodeLayout
            elif _padding_dominates(meta):
                context_kind = _SplitLayout
            else:  # the mirror serves short runs (verification), drops out for prompt chunks
                context_kind = _MixedLayout
            kind = lambda: context_kind(meta, mirror)  # noqa: E731
        if (meta.max_query_len <= MAX_KERNEL_RUN and meta.slot_mapping.device.type == "cpu"
                and cpu_kernels.load() is not None):
            layout: _Layout = _KernelRunsLayout(meta, mirror, kind)
        else:
            layout = kind()
        meta.backend_state["torch"] = layout

    def rotate_and_write_kv(self, qkv, rotary, rope, k_cache, v_cache, meta) -> torch.Tensor:
        """float32 on the CPU: one C++ pass (csrc/rope_kv.cpp, bit-identical to the unfused
        path) rotates q and k and writes k and v to the cache and the mirror; elsewhere the
        base class's rotate, then write_kv."""
        if not (rotary.rotary_dim == rotary.head_dim and qkv.is_contiguous()
                and qkv.dtype == k_cache.dtype and cpu_kernels.available(qkv)):
            return super().rotate_and_write_kv(qkv, rotary, rope, k_cache, v_cache, meta)
        half = k_cache.shape[3] // 2
        return self._rope_write_kv(qkv, rope.cos.view(-1, half), rope.sin[:, 0, 1], k_cache,
                                   v_cache, meta.slot_mapping,
                                   meta.backend_state.get("torch"))  # [T, H, D]

    def _rope_write_kv(self, qkv, cos, sin, k_cache, v_cache, slots,
                       layout: _Layout | None) -> torch.Tensor:
        """The C++ rotary + KV write of a float32 qkv [T, (H + 2 KvH) D] with full-width
        rotation; cos, sin [T, D / 2]; layout None when called outside a prepared step.
        Returns the rotated queries [T, H, D]."""
        k_flat, v_flat, kv_heads = self._cache_views(k_cache, v_cache)
        num_heads = qkv.shape[1] // k_cache.shape[3] - 2 * kv_heads
        extra = None if layout is None else layout.extra_kv_rows(k_cache)
        return cpu_kernels.load().rope_write_kv(
            qkv, cos, sin, num_heads, kv_heads, k_flat, v_flat, slots,
            *(extra or ()))  # [T, H, D]

    def write_kv(self, key, value, k_cache, v_cache, meta) -> None:
        k_cache.view(-1, *k_cache.shape[2:]).index_copy_(0, meta.slot_mapping, key)
        v_cache.view(-1, *v_cache.shape[2:]).index_copy_(0, meta.slot_mapping, value)
        self.mirror.cache_tokens = k_cache.shape[0] * k_cache.shape[1]
        layout = meta.backend_state.get("torch")  # None when called outside a prepared step
        if layout is not None:
            layout.wrote_kv(key, value, k_cache)

    def forward(self, query, k_cache, v_cache, meta, scale) -> torch.Tensor:
        return meta.backend_state["torch"].attend(query, k_cache, v_cache, scale)  # [T, H, D]

    def layer_pass(self, meta, rotary, rope):
        """Decode and verification steps in float32 with the CPU kernels: per layer, the C++
        rotary + KV write (rotate_and_write_kv's fast branch) and the step's attention
        (_KernelRunsLayout.attend), with no other Python between them. The checks that
        rotate_and_write_kv repeats in every layer are made once for the step, or per layer
        where they depend on the layer; a layer that fails them, and a step of any other
        layout, goes through forward_packed as before."""
        layout = meta.backend_state.get("torch")
        if (type(layout) is not _KernelRunsLayout or cpu_kernels.load() is None
                or rotary.rotary_dim != rotary.head_dim or rope.cos.dtype != torch.float32):
            return None
        half = rotary.head_dim // 2
        cos, sin = rope.cos.view(-1, half), rope.sin[:, 0, 1]  # as rotate_and_write_kv passes
        slots = meta.slot_mapping
        step = layout.mirror
        if step is not None and step.extend and rotary.head_dim in KERNEL_HEAD_DIMS:
            return self._extend_pass(meta, rotary, rope, layout, step, cos, sin)

        def run(qkv: torch.Tensor, attention) -> torch.Tensor:
            k_cache, v_cache = attention.k_cache, attention.v_cache
            if not (qkv.is_contiguous() and qkv.dtype == k_cache.dtype == torch.float32
                    and k_cache.shape[3] == rotary.head_dim):
                return attention.forward_packed(qkv, rotary, rope, meta)
            query = self._rope_write_kv(qkv, cos, sin, k_cache, v_cache, slots, layout)
            out = layout.attend(query, k_cache, v_cache, attention.scale)  # [T, H, D]
            return out.view(qkv.shape[0], -1)  # [T, H * D]

        return run

    def _extend_pass(self, meta, rotary, rope, layout: _KernelRunsLayout, step: MirrorStep,
                     cos: torch.Tensor, sin: torch.Tensor):
        """layer_pass for a step that extends the context mirror (nearly every decode and
        verification step): the same two C++ calls with the same arguments as run() above,
        without building them again in every layer. The mirror's views come from
        MirrorStep.kernel_views (kept across steps while the batch's rows stay put), a
        cache's flattened views and head count from _cache_views, and the attention reads
        the mirror rows whole (run_attention reads each sequence's keys up to its length,
        so this is the same computation as through context()'s views, which stop at the
        longest length). In SmolLM2's decode step this Python cost 18 us per layer, ~0.5 ms
        of an 8-10 ms step."""
        kernels = cpu_kernels.load()
        slots, query_start, seq_lens = meta.slot_mapping, layout.query_start, layout.seq_lens
        head_dim = rotary.head_dim

        def run(qkv: torch.Tensor, attention) -> torch.Tensor:
            k_cache = attention.k_cache
            if not (qkv.dtype == k_cache.dtype == torch.float32 and qkv.is_contiguous()
                    and k_cache.shape[3] == head_dim):
                return attention.forward_packed(qkv, rotary, rope, meta)
            k_flat, v_flat, kv_heads = self._cache_views(k_cache, attention.v_cache)
            k_rows, v_rows, k_ctx, v_ctx = step.kernel_views(k_cache)
            query = kernels.rope_write_kv(qkv, cos, sin, qkv.shape[1] // head_dim - 2 * kv_heads,
                                          kv_heads, k_flat, v_flat, slots, k_rows, v_rows,
                                          step.index)  # [T, H, D]
            out = kernels.run_attention(query, k_ctx, v_ctx, query_start, seq_lens,
                                        attention.scale)  # [T, H, D]
            return out.view(qkv.shape[0], -1)  # [T, H * D]

        return run

    def _cache_views(self, k_cache: torch.Tensor, v_cache: torch.Tensor
                     ) -> tuple[torch.Tensor, torch.Tensor, int]:
        """A layer's K and V caches as [slots, KvH, D] views, and KvH: made on the layer's
        first call and kept (the caches live as long as the runner)."""
        known = self._kernel_layers.get(k_cache.data_ptr())
        if known is None or known[0] is not k_cache:
            kv_heads, head_dim = k_cache.shape[2], k_cache.shape[3]
            self.mirror.cache_tokens = k_cache.shape[0] * k_cache.shape[1]
            known = self._kernel_layers[k_cache.data_ptr()] = (
                k_cache, k_cache.view(-1, kv_heads, head_dim),
                v_cache.view(-1, kv_heads, head_dim), kv_heads)
        return known[1:]
