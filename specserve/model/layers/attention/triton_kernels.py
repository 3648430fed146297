"""Triton kernels for paged attention: the KV-cache write (plain, or fused with the rotary
embedding), the attention kernel, the split reduce.

The attention kernel serves decode, speculative verification and prefill chunks with ONE code
path. A program owns (sequence, KV head, query tile[, context split]) and holds, as the rows of
its query tile, every query token of the tile times every query head of that KV head's group
(GQA): row r is token ``r // GROUP`` of the tile and head ``r % GROUP`` of the group. Each K/V
block it loads is therefore read once for all of those rows, which is what makes verifying
``k + 1`` tokens cost about what decoding one does: the kernel is bound by reading the KV cache,
and the extra rows only add tensor-core work on data that is already in registers/shared memory.

Causality: query token i of a run of length q_len in a sequence whose context after this step is
seq_len sits at position ``seq_len - q_len + i`` and sees keys ``<= `` that position.

Flash-decoding: with few sequences the (sequence, KV head) grid cannot fill the GPU, so the
context is cut into ``num_splits`` contiguous ranges of BLOCK_N-key chunks, one program each;
each writes its unnormalised partial (running max, running sum, accumulator) and a second small
kernel merges them. Every range is derived in the kernel from the device ``seq_lens``, so the
host only chooses the number of splits (no host sync, graph-capturable).

Scores use base-2 exponentials (``exp2``) with ``scale * log2(e)`` folded into the scale, as
flash attention does; the running max starts at a large finite negative value instead of -inf so
that a row whose keys in this split are all masked never computes ``-inf - -inf``.
"""

from __future__ import annotations

import triton
import triton.language as tl

from specserve.model.layers import pdl_jit

# Running max before any key is seen: finite, so exp2(m_old - m_new) never sees inf - inf.
NEG_BIG = tl.constexpr(-1.0e30)


@triton.jit
def write_kv_kernel(
    key_ptr, value_ptr, k_cache_ptr, v_cache_ptr, slot_ptr,
    stride_kt, stride_kh, stride_vt, stride_vh,
    stride_kcb, stride_kcs, stride_kch,
    stride_vcb, stride_vcs, stride_vch,
    PAGE: tl.constexpr, KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr, PDL: tl.constexpr,
):
    """One program per token: key/value [KvH, D] -> cache[slot // PAGE, slot % PAGE].

    A negative slot is skipped: padded tokens (e.g. in a captured CUDA graph) write nothing."""
    pdl_jit.release_and_wait(PDL)  # layers/pdl.py
    t = tl.program_id(0)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    if slot >= 0:
        blk = slot // PAGE
        off = slot % PAGE
        h = tl.arange(0, BLOCK_H)
        d = tl.arange(0, BLOCK_D)
        mask = (h[:, None] < KV_HEADS) & (d[None, :] < HEAD_DIM)
        t64 = t.to(tl.int64)
        k = tl.load(key_ptr + t64 * stride_kt + h[:, None] * stride_kh + d[None, :], mask=mask)
        v = tl.load(value_ptr + t64 * stride_vt + h[:, None] * stride_vh + d[None, :], mask=mask)
        tl.store(k_cache_ptr + blk * stride_kcb + off * stride_kcs + h[:, None] * stride_kch
                 + d[None, :], k, mask=mask)
        tl.store(v_cache_ptr + blk * stride_vcb + off * stride_vcs + h[:, None] * stride_vch
                 + d[None, :], v, mask=mask)


@triton.jit
def rotary_write_kv_kernel(
    qkv_ptr, cos_ptr, sin_ptr, q_out_ptr, k_cache_ptr, v_cache_ptr, slot_ptr,
    stride_t, stride_qt, stride_qh, stride_ct, stride_st,
    stride_kcb, stride_kcs, stride_kch,
    stride_vcb, stride_vcs, stride_vch,
    NUM_HEADS: tl.constexpr, KV_HEADS: tl.constexpr, HALF: tl.constexpr,
    BLOCK_D: tl.constexpr, PAGE: tl.constexpr, PDL: tl.constexpr,
):
    """grid = (num_tokens, H + 2 * KvH): one program per head of a packed projection row.

    qkv [T, (H + 2 * KvH) * 2 * HALF]: q heads, then k heads, then v heads ("rotate half"
    layout); cos [T, HALF] and sin [T, 2, HALF] = (-sin, +sin) in float32 (RotaryTable).
    q heads are rotated into q_out [T, H, 2 * HALF]; k heads are rotated and v heads copied
    into the caches at cache[slot // PAGE, slot % PAGE]. The rotation is the rotary kernel's
    (float32, rounded to qkv's dtype), so the cache holds what rotary + write_kv stored.
    A negative slot (padded token) writes no K/V; its q row is still written."""
    pdl_jit.release_and_wait(PDL)  # layers/pdl.py
    t = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    d = tl.arange(0, BLOCK_D)
    d_ok = d < HALF
    src = qkv_ptr + t * stride_t + head * (2 * HALF) + d
    if head < NUM_HEADS + KV_HEADS:  # q or k: rotate
        x1 = tl.load(src, mask=d_ok, other=0.0).to(tl.float32)  # [HALF]
        x2 = tl.load(src + HALF, mask=d_ok, other=0.0).to(tl.float32)
        c = tl.load(cos_ptr + t * stride_ct + d, mask=d_ok, other=0.0)
        s_lo = tl.load(sin_ptr + t * stride_st + d, mask=d_ok, other=0.0)  # -sin
        s_hi = tl.load(sin_ptr + t * stride_st + HALF + d, mask=d_ok, other=0.0)  # +sin
        o1 = (x1 * c + x2 * s_lo).to(qkv_ptr.dtype.element_ty)
        o2 = (x2 * c + x1 * s_hi).to(qkv_ptr.dtype.element_ty)
        if head < NUM_HEADS:
            dst = q_out_ptr + t * stride_qt + head * stride_qh + d
            tl.store(dst, o1, mask=d_ok)
            tl.store(dst + HALF, o2, mask=d_ok)
        else:
            slot = tl.load(slot_ptr + t).to(tl.int64)
            if slot >= 0:
                dst = (k_cache_ptr + (slot // PAGE) * stride_kcb + (slot % PAGE) * stride_kcs
                       + (head - NUM_HEADS) * stride_kch + d)
                tl.store(dst, o1, mask=d_ok)
                tl.store(dst + HALF, o2, mask=d_ok)
    else:  # v: copy
        slot = tl.load(slot_ptr + t).to(tl.int64)
        if slot >= 0:
            dst = (v_cache_ptr + (slot // PAGE) * stride_vcb + (slot % PAGE) * stride_vcs
                   + (head - NUM_HEADS - KV_HEADS) * stride_vch + d)
            tl.store(dst, tl.load(src, mask=d_ok), mask=d_ok)
            tl.store(dst + HALF, tl.load(src + HALF, mask=d_ok), mask=d_ok)


# Integer arguments that change from step to step are not specialized on (Triton would
# otherwise compile a variant per value class, ==1 or divisible by 16, each ~0.3-0.8 s the first
# time an eager step meets it: a stall in the middle of serving).
@triton.jit(do_not_specialize=["num_splits", "stride_bt"])
def paged_attention_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, out_ptr,
    part_m_ptr, part_l_ptr, part_acc_ptr,
    block_tables_ptr, seq_lens_ptr, query_start_loc_ptr,
    scale_log2, num_splits, num_heads,
    stride_qt, stride_qh, stride_ot, stride_oh,
    stride_kb, stride_ks, stride_kh,
    stride_vb, stride_vs, stride_vh,
    stride_bt,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr, PAGE: tl.constexpr,
    SPLIT: tl.constexpr, PRECISION: tl.constexpr, DOT_F32: tl.constexpr, PDL: tl.constexpr,
):
    """grid = (num_seqs, kv_heads, num_q_tiles * num_splits).

    query [T, H, D] and out [T, H, D] (last dim contiguous); caches [N, PAGE, KvH, D];
    block_tables [S, max_blocks] int32; seq_lens [S]; query_start_loc [S + 1].
    Partials (SPLIT only): m, l [T, H, num_splits] and acc [T, H, num_splits, HEAD_DIM], fp32.
    DOT_F32 upcasts the dot operands to fp32: only for bf16 under the CPU interpreter, whose
    bf16 ``tl.dot`` multiplies the raw uint16 storage (triton 3.9); never set on a GPU.
    """
    pdl_jit.release_and_wait(PDL)  # layers/pdl.py
    seq = tl.program_id(0)
    kvh = tl.program_id(1)
    tile = tl.program_id(2) // num_splits
    split = tl.program_id(2) % num_splits

    q_start = tl.load(query_start_loc_ptr + seq)
    q_len = tl.load(query_start_loc_ptr + seq + 1) - q_start
    tile_start = tile * BLOCK_M
    # Tiles past this run's length exist because the grid is sized by the longest run.
    if tile_start < q_len:
        seq_len = tl.load(seq_lens_ptr + seq)
        ctx = seq_len - q_len  # absolute position of the run's first query token

        rows = tl.arange(0, BLOCK_R)
        m_off = tile_start + rows // GROUP  # [R] token offset inside the run
        head = kvh * GROUP + rows % GROUP  # [R] query head
        row_ok = (rows < BLOCK_M * GROUP) & (m_off < q_len)
        q_pos = ctx + m_off  # [R]
        d = tl.arange(0, BLOCK_D)
        d_ok = d < HEAD_DIM
        token = (q_start + m_off).to(tl.int64)  # [R]
        q = tl.load(q_ptr + token[:, None] * stride_qt + head[:, None] * stride_qh + d[None, :],
                    mask=row_ok[:, None] & d_ok[None, :], other=0.0)  # [R, D]
        if DOT_F32:
            q = q.to(tl.float32)

        # Keys this tile can see end after its last real query token.
        kv_end = ctx + tl.minimum(tile_start + BLOCK_M, q_len)
        n_chunks = tl.cdiv(kv_end, BLOCK_N)
        if SPLIT:
            per_split = tl.cdiv(n_chunks, num_splits)
            c_lo = split * per_split
            c_hi = tl.minimum(c_lo + per_split, n_chunks)
        else:
            c_lo = 0
            c_hi = n_chunks

        m_i = tl.full([BLOCK_R], NEG_BIG, dtype=tl.float32)
        l_i = tl.zeros([BLOCK_R], dtype=tl.float32)
        acc = tl.zeros([BLOCK_R, BLOCK_D], dtype=tl.float32)
        bt_row = block_tables_ptr + seq.to(tl.int64) * stride_bt
        n = tl.arange(0, BLOCK_N)
        kv_mask_d = d_ok[None, :]
        for c in range(c_lo, c_hi):
            k_pos = c * BLOCK_N + n  # [N]
            k_ok = k_pos < kv_end
            page = tl.load(bt_row + k_pos // PAGE, mask=k_ok, other=0).to(tl.int64)  # [N]
            in_page = k_pos % PAGE
            k_off = page * stride_kb + in_page * stride_ks + kvh * stride_kh  # [N]
            v_off = page * stride_vb + in_page * stride_vs + kvh * stride_vh
            k = tl.load(k_cache_ptr + k_off[:, None] + d[None, :],
                        mask=k_ok[:, None] & kv_mask_d, other=0.0)  # [N, D]
            if DOT_F32:
                k = k.to(tl.float32)
            s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale_log2  # [R, N]
            allowed = (k_pos[None, :] <= q_pos[:, None]) & k_ok[None, :]
            s = tl.where(allowed, s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, 1))  # [R]
            alpha = tl.exp2(m_i - m_new)
            p = tl.exp2(s - m_new[:, None])  # [R, N]
            l_i = l_i * alpha + tl.sum(p, 1)
            v = tl.load(v_cache_ptr + v_off[:, None] + d[None, :],
                        mask=k_ok[:, None] & kv_mask_d, other=0.0)  # [N, D]
            if DOT_F32:
                v = v.to(tl.float32)
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
            m_i = m_new

        if SPLIT:
            # [T, H, num_splits] partials; every split of a real row writes (maybe empty).
            part = (token * num_heads + head) * num_splits + split  # [R]
            tl.store(part_m_ptr + part, m_i, mask=row_ok)
            tl.store(part_l_ptr + part, l_i, mask=row_ok)
            tl.store(part_acc_ptr + part[:, None] * HEAD_DIM + d[None, :], acc,
                     mask=row_ok[:, None] & d_ok[None, :])
        else:
            out = acc / l_i[:, None]
            tl.store(out_ptr + token[:, None] * stride_ot + head[:, None] * stride_oh + d[None, :],
                     out.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & d_ok[None, :])


@triton.jit(do_not_specialize=["num_splits"])
def reduce_splits_kernel(
    part_m_ptr, part_l_ptr, part_acc_ptr, out_ptr,
    num_splits, num_heads, stride_ot, stride_oh,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_S: tl.constexpr, PDL: tl.constexpr,
):
    """grid = (num_tokens, num_heads): merge the splits' (max, sum, acc) into the output row."""
    pdl_jit.release_and_wait(PDL)  # layers/pdl.py
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    s = tl.arange(0, BLOCK_S)
    s_ok = s < num_splits
    d = tl.arange(0, BLOCK_D)
    d_ok = d < HEAD_DIM
    base = (t * num_heads + h) * num_splits
    m = tl.load(part_m_ptr + base + s, mask=s_ok, other=NEG_BIG)  # [S]
    l_s = tl.load(part_l_ptr + base + s, mask=s_ok, other=0.0)
    m_max = tl.max(m, 0)
    w = tl.exp2(m - m_max)  # [S]; empty or padded splits carry l = 0 and acc = 0
    acc = tl.load(part_acc_ptr + (base + s)[:, None] * HEAD_DIM + d[None, :],
                  mask=s_ok[:, None] & d_ok[None, :], other=0.0)  # [S, D]
    out = tl.sum(acc * w[:, None], 0) / tl.sum(l_s * w, 0)  # [D]
    tl.store(out_ptr + t * stride_ot + h * stride_oh + d, out.to(out_ptr.dtype.element_ty),
             mask=d_ok)
