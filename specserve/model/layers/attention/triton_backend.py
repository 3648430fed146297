"""Paged attention through Triton kernels (the CUDA backend; CPU only under TRITON_INTERPRET=1).

* ``write_kv``: one Triton program per token stores its K/V heads at its slot;
  ``rotate_and_write_kv`` does the same for a packed q/k/v projection and rotates q and k on the
  way (one kernel where the model would otherwise launch the rotary kernel and then this one).
* ``forward``: one kernel launch serves every sequence's query run, whatever its length (decode,
  ``k + 1`` verification tokens, prefill chunks over a cached prefix): see triton_kernels.py for
  the tile layout (query tokens x GQA group as rows, so each K/V block is read once per tile).
  With few sequences and long contexts the context is split across programs (flash-decoding)
  and a small second kernel merges the partial softmax states.
* A step made of ONE whole prompt (no cached prefix) goes to torch SDPA with ``is_causal``: its
  context is exactly this step's tokens, so K/V are a single contiguous gather, and torch's
  flash/cuDNN kernels are tuned for long causal prefill: on an H200 (Llama-3-8B heads, bf16)
  96 us vs 154 us for this kernel at 2048 tokens, 1.0 vs 2.0 ms at 8192. Several whole prompts
  at once stay on the Triton kernel (no padding, no varlen API needed).

Everything that depends only on the batch is decided on the host in ``prepare`` (from the host
lists in the metadata); what also depends on the layer's head counts (the query-tile size and
the number of context splits) is derived on the first layer's call and cached for the step.
``forward`` itself never reads device memory on the host, so it can be captured in a CUDA graph
as long as the graph fixes the split count (the kernels take every range from ``seq_lens`` on
the device; any split count gives the same result).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from specserve.model.layers import pdl
from specserve.model.layers.attention import triton_kernels as kernels
from specserve.model.layers.attention.backend import AttentionBackend
from specserve.model.layers.attention.metadata import AttentionMetadata

LOG2E = 1.4426950408889634
MAX_TILE_ROWS = 128  # query rows (tokens x group heads) per program: one tensor-core tile
MIN_TILE_ROWS = 16  # tl.dot needs M >= 16; decode rows are padded up to it
# Keys per context split: 128 beat 256 and 512 at batch 1 (H200, Llama-3-8B attention shapes).
MIN_KEYS_PER_SPLIT = 128
MAX_SPLITS = 64
# rotate_and_write_kv in one kernel (rotary + write_kv fused): one launch fewer per layer.
FUSED_ROTARY_KV = True
KV_TILE_BYTES = 32 * 1024  # cap on one K (or V) tile: keeps fp32 / head_dim 256 in shared memory
# Query rows per program -> (keys per inner iteration, num_warps, num_stages), the fastest of 8
# configs on an H200 (triton 3.6, bf16, head_dim 128, group 4; tests/gpu/check_triton_attention.py
# --tune). With group 4, rows 16 serve runs of 1-4 tokens (decode, k <= 3), 32 runs of 5-8, 64
# runs of 9-16, 128 prefill tiles. Rows above 128 (huge GQA groups) use 128's entry. Rows 32 and
# 64 were then retuned inside the batch-1 verification graph, where the kernel overlaps its
# neighbours under PDL (tests/gpu/tune_rows_in_graph.py, 2026-12-04: (128, 4, 3) -> (64, 4, 2)
# and (64, 4, 3) -> (32, 4, 2), -1.1 % and -0.4 % of the graph at q = 5 and 9).
TILE_CONFIG: dict[int, tuple[int, int, int]] = {
    16: (64, 4, 2), 32: (64, 4, 2), 64: (32, 4, 2), 128: (32, 4, 3),
}


@dataclass(frozen=True)
class _LaunchShape:
    """Per (step, head layout): tile geometry and split count, all host integers."""

    block_r: int  # rows per program (power of two)
    block_m: int  # query tokens per program
    q_tiles: int
    num_splits: int
    block_n: int  # keys per inner iteration
    num_warps: int
    num_stages: int


@dataclass
class _StepPlan:
    num_seqs: int
    max_query_len: int
    max_seq_len: int
    single_prompt: bool  # one whole prompt from position 0: the SDPA path
    shapes: dict[tuple[int, int], _LaunchShape] = field(default_factory=dict)
    scratch: dict[tuple, tuple[torch.Tensor, ...]] = field(default_factory=dict)


def _pow2(x: int) -> int:
    return 1 << max(0, x - 1).bit_length()


class TritonAttentionBackend(AttentionBackend):
    name = "triton"
    supports_cuda_graphs = True

    def __init__(self, num_splits: int | None = None, num_sms: int | None = None,
                 sdpa_prefill: bool = True,
                 tile_config: dict[int, tuple[int, int, int]] | None = None,
                 min_keys_per_split: int = MIN_KEYS_PER_SPLIT,
                 fused_rotary_kv: bool | None = None) -> None:
        """num_splits: force the context split count (tests; a CUDA graph fixes it per capture).
        num_sms: programs to aim for = 2 x this (default: the current CUDA device's SM count;
        2x beat 4x and 8x in the H200 sweep).
        sdpa_prefill: send single whole-prompt steps to torch SDPA.
        tile_config, min_keys_per_split: tuning knobs (see TILE_CONFIG).
        fused_rotary_kv: rotate q/k and write K/V in one kernel (default FUSED_ROTARY_KV; a
        switch for A/B timing and tests, both settings give the same result)."""
        self.fused_rotary_kv = FUSED_ROTARY_KV if fused_rotary_kv is None else fused_rotary_kv
        self.forced_splits = num_splits
        self.tile_config = {**TILE_CONFIG, **(tile_config or {})}
        self.min_keys_per_split = min_keys_per_split
        if num_sms is None:
            num_sms = (torch.cuda.get_device_properties(torch.cuda.current_device())
                       .multi_processor_count if torch.cuda.is_available() else 132)
        self.target_programs = 2 * num_sms
        self.sdpa_prefill = sdpa_prefill

    # ---- per step ----------------------------------------------------------------------------
    def prepare(self, meta: AttentionMetadata) -> None:
        single = (self.sdpa_prefill and meta.num_seqs == 1
                  and meta.query_lens[0] == meta.seq_lens_host[0])
        meta.backend_state["triton"] = _StepPlan(meta.num_seqs, meta.max_query_len,
                                                 meta.max_seq_len, single)

    def _launch_shape(self, plan: _StepPlan, num_heads: int, kv_heads: int) -> _LaunchShape:
        shape = plan.shapes.get((num_heads, kv_heads))
        if shape is not None:
            return shape
        group = num_heads // kv_heads
        # One tile for the whole run when it fits (decode, verification); else the largest
        # tile of at most MAX_TILE_ROWS rows. Rows are a power of two and the token count fills
        # them, so q_len 2..4 with group 4 all compile to the same 16-row kernel.
        rows = _pow2(max(MIN_TILE_ROWS, plan.max_query_len * group))
        if rows > MAX_TILE_ROWS:
            rows = max(MAX_TILE_ROWS, _pow2(group))
        block_m = max(1, rows // group)
        q_tiles = math.ceil(plan.max_query_len / block_m)
        if self.forced_splits is not None:
            splits = self.forced_splits
        else:
            # Split only while the grid is short of the target: rounding up would split a
            # batch of 32 sequences x 8 KV heads (256 programs vs 264 wanted) in two, paying a
            # reduce kernel per layer (29 us in a batch-32 draft catch-up on the H200) for
            # nothing.
            base = plan.num_seqs * kv_heads * q_tiles
            splits = min(max(1, self.target_programs // base),
                         math.ceil(plan.max_seq_len / self.min_keys_per_split), MAX_SPLITS)
        block_n, warps, stages = self.tile_config[min(rows, MAX_TILE_ROWS)]
        shape = _LaunchShape(rows, block_m, q_tiles, max(1, splits), block_n, warps, stages)
        plan.shapes[(num_heads, kv_heads)] = shape
        return shape

    def _partials(self, plan: _StepPlan, num_tokens: int, num_heads: int, head_dim: int,
                  splits: int, device: torch.device) -> tuple[torch.Tensor, ...]:
        """fp32 (m, l) [T, H, splits] and acc [T, H, splits, D], shared by the step's layers."""
        key = (num_tokens, num_heads, head_dim, splits)
        bufs = plan.scratch.get(key)
        if bufs is None:
            kw = {"dtype": torch.float32, "device": device}
            bufs = (torch.empty(num_tokens, num_heads, splits, **kw),
                    torch.empty(num_tokens, num_heads, splits, **kw),
                    torch.empty(num_tokens, num_heads, splits, head_dim, **kw))
            plan.scratch[key] = bufs
        return bufs

    # ---- per layer ---------------------------------------------------------------------------
    def write_kv(self, key, value, k_cache, v_cache, meta) -> None:
        num_tokens, kv_heads, head_dim = key.shape
        if num_tokens == 0:
            return
        key = key if key.stride(-1) == 1 else key.contiguous()
        value = value if value.stride(-1) == 1 else value.contiguous()
        kernels.write_kv_kernel[(num_tokens,)](
            key, value, k_cache, v_cache, meta.slot_mapping,
            key.stride(0), key.stride(1), value.stride(0), value.stride(1),
            k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
            v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
            PAGE=k_cache.shape[1], KV_HEADS=kv_heads, HEAD_DIM=head_dim,
            BLOCK_H=_pow2(kv_heads), BLOCK_D=_pow2(head_dim), **pdl.launch_options(key),
        )

    def rotate_and_write_kv(self, qkv, rotary, rope, k_cache, v_cache, meta) -> torch.Tensor:
        """One kernel instead of rotary + write_kv (the base class's path, kept for partial
        rotary dims and when fused_rotary_kv is off): same values in q and the caches."""
        num_tokens = qkv.shape[0]
        kv_heads, head_dim = k_cache.shape[2], k_cache.shape[3]
        num_heads = qkv.shape[1] // head_dim - 2 * kv_heads
        if (not self.fused_rotary_kv or rotary.rotary_dim != head_dim or qkv.stride(-1) != 1
                or head_dim % 2):
            return super().rotate_and_write_kv(qkv, rotary, rope, k_cache, v_cache, meta)
        half = head_dim // 2
        q = torch.empty(num_tokens, num_heads, head_dim, dtype=qkv.dtype,
                        device=qkv.device)  # [T, H, D]
        if num_tokens == 0:
            return q
        cos = rope.cos.reshape(num_tokens, half)  # [T, D/2] float32
        sin = rope.sin.reshape(num_tokens, 2 * half)  # [T, 2 * D/2]: (-sin, +sin)
        kernels.rotary_write_kv_kernel[(num_tokens, num_heads + 2 * kv_heads)](
            qkv, cos, sin, q, k_cache, v_cache, meta.slot_mapping,
            qkv.stride(0), q.stride(0), q.stride(1), cos.stride(0), sin.stride(0),
            k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
            v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
            NUM_HEADS=num_heads, KV_HEADS=kv_heads, HALF=half, BLOCK_D=_pow2(half),
            PAGE=k_cache.shape[1], num_warps=1, **pdl.launch_options(qkv),
        )
        return q

    def forward(self, query, k_cache, v_cache, meta, scale) -> torch.Tensor:
        plan: _StepPlan = meta.backend_state["triton"]
        if plan.single_prompt:
            return self._sdpa_prefill(query, k_cache, v_cache, meta, scale)
        num_tokens, num_heads, head_dim = query.shape
        kv_heads = k_cache.shape[2]
        shape = self._launch_shape(plan, num_heads, kv_heads)
        query = query if query.stride(-1) == 1 else query.contiguous()
        out = torch.empty(num_tokens, num_heads, head_dim, dtype=query.dtype,
                          device=query.device)  # [T, H, D]
        split = shape.num_splits > 1
        if split:
            part_m, part_l, part_acc = self._partials(plan, num_tokens, num_heads, head_dim,
                                                      shape.num_splits, query.device)
        else:
            part_m = part_l = part_acc = out  # unused by the kernel
        block_d = max(16, _pow2(head_dim))
        block_n = min(shape.block_n, max(16, KV_TILE_BYTES // (block_d * k_cache.element_size())))
        # CPU tensors only run under the Triton interpreter, whose bf16 dot is broken.
        interp_bf16 = query.dtype == torch.bfloat16 and query.device.type == "cpu"
        grid = (plan.num_seqs, kv_heads, shape.q_tiles * shape.num_splits)
        kernels.paged_attention_kernel[grid](
            query, k_cache, v_cache, out, part_m, part_l, part_acc,
            meta.block_tables, meta.seq_lens, meta.query_start_loc,
            scale * LOG2E, shape.num_splits, num_heads,
            query.stride(0), query.stride(1), out.stride(0), out.stride(1),
            k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
            v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
            meta.block_tables.stride(0),
            GROUP=num_heads // kv_heads, HEAD_DIM=head_dim, BLOCK_D=block_d,
            BLOCK_M=shape.block_m, BLOCK_R=shape.block_r, BLOCK_N=block_n,
            PAGE=k_cache.shape[1], SPLIT=split,
            # fp32 callers asked for fp32: keep tf32 out of the dot products.
            PRECISION="ieee" if query.dtype == torch.float32 or interp_bf16 else "tf32",
            DOT_F32=interp_bf16,
            num_warps=shape.num_warps, num_stages=shape.num_stages, **pdl.launch_options(query),
        )
        if split:
            kernels.reduce_splits_kernel[(num_tokens, num_heads)](
                part_m, part_l, part_acc, out, shape.num_splits, num_heads,
                out.stride(0), out.stride(1),
                # two variants only (each new one is a compile in the middle of serving)
                HEAD_DIM=head_dim, BLOCK_D=block_d,
                BLOCK_S=16 if shape.num_splits <= 16 else _pow2(MAX_SPLITS),
                num_warps=4, **pdl.launch_options(out),
            )
        return out

    def _sdpa_prefill(self, query, k_cache, v_cache, meta, scale) -> torch.Tensor:
        """One whole prompt: its keys/values are exactly this step's slots (just written)."""
        num_tokens, num_heads, _ = query.shape
        kv_heads = k_cache.shape[2]
        k = k_cache.view(-1, *k_cache.shape[2:]).index_select(0, meta.slot_mapping)  # [T, KvH, D]
        v = v_cache.view(-1, *v_cache.shape[2:]).index_select(0, meta.slot_mapping)
        out = F.scaled_dot_product_attention(
            query.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None],
            is_causal=True, scale=scale, enable_gqa=num_heads != kv_heads,
        )  # [1, H, T, D]
        return out[0].transpose(0, 1)  # [T, H, D]

