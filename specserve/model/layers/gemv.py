"""Multi-row matrix-vector product: out [M, N] = x [M, K] @ weight [N, K].T for 2 <= M <= 16.

Why: a batch-1 verification step runs every projection on k+1 = 2..9 rows. At that size the
product is bound by streaming the weight once, exactly as a one-row decode step is, but cuBLAS
picks kernels for these shapes that leave bandwidth unused, so a verify step cost ~10% more than
a decode step on an H200. These kernels read each weight element once for all M rows, so a
verify step costs about what a decode step does: on an H200 (tests/gpu/sweep_gemv.py,
2026-12-03) Llama-3-8B's 32 layers of projections plus the lm_head took 3.96-4.00 ms at 2..9
rows, against 3.86 ms for the one-row kernel at 1 row and 4.12-4.31 ms through cuBLAS.

Two variants (chosen per shape and row bucket by a sweep on the H200,
tests/gpu/sweep_gemv.py):
- "fma": the one-row kernel (triton_ops.gemv) with a row dimension: a float32 accumulator
  [BLOCK_M, BLOCK_N, BLOCK_K] of plain FMAs, summed over K once at the end. Many small programs
  (BLOCK_N = 2..8 weight rows each), but BLOCK_M FMAs per weight element, so it runs out of
  arithmetic as M grows.
- "dot": tensor cores, [BLOCK_N, BLOCK_K] weight tile @ [BLOCK_K, BLOCK_M] x tile, x padded with
  zero rows up to BLOCK_M >= 16 (tl.dot's minimum); the arithmetic is free, only the weight
  stream counts.
Two schedules that fill every SM were built, tested and measured on the H200 in sessions 12-13
and lost to "dot" at every 8B shape and row bucket (BENCHMARKS.md, "H200, session 13"): a
persistent one (one program per SM walking several weight-row blocks: +0.3-4 us) and a
deterministic split-K (partials in a float32 workspace, added in order by the last program of a
block: +0.7-22 us). So they are not here.

All accumulate in float32 and write x's dtype; the bias (optional) is added in float32. Row
count and shapes are host ints only, so the launch is CUDA-graph safe. The CPU path never comes
here except under TRITON_INTERPRET=1 (tests).
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import torch

from specserve.model.layers import pdl

MAX_ROWS = 16  # largest M served here; larger batches are matmuls for cuBLAS
MIN_DOT_ROWS = 16  # tl.dot needs every dimension >= 16, so x is padded to 16 rows
VARIANTS = ("fma", "dot")


class RowsConfig(NamedTuple):
    """Launch parameters of one (shape, row bucket)."""
    variant: str  # one of VARIANTS
    block_n: int  # weight rows (output columns) per program
    block_k: int  # reduction chunk per loop iteration
    num_warps: int
    num_stages: int
    # Weight rows (output columns) a program covers, <= block_n; 0 means block_n. Fewer rows
    # than the tile spread a shape over more programs (the tile's other rows are masked and
    # never read): the 8B qkv (6144 rows) in 64-row tiles runs 96 programs and leaves 36 of an
    # H200's 132 SMs without a weight stream, while 48 rows per program runs 128.
    rows_per_program: int = 0

    @property
    def pairs_rows(self) -> bool:
        """Every program covers whole gate/up row pairs (what gate_up_silu_rows needs)."""
        return self.block_n % 2 == 0 and self.rows_per_program % 2 == 0


# Per (N, K, row bucket): the fastest config of tests/gpu/sweep_gemv.py on an H200 (2026-12-03;
# the "dot" variant everywhere except 2-row 2048-row shapes), listed where it beat cuBLAS
# (torch.nn.functional.linear) by >= 1% at every M of the bucket in both sweeps, plus the 8B
# gate_up whose kernel ties cuBLAS's best (within 1%) and avoids the 8% slower kernel cuBLAS
# picks at some M. Other shapes and buckets (the 1B down at 3+ rows: cuBLAS 1-3% faster) keep
# cuBLAS. Llama-3-8B: qkv, o, gate_up, down, lm_head; Llama-3.2-1B: the same at hidden 2048.
# The 8B layer shapes were then retuned inside the batch-1 verification graph, where a kernel
# overlaps its neighbours under PDL (tests/gpu/tune_rows_in_graph.py, 2026-12-04: qkv and o at
# 5-16 rows and gate_up at 2-4 rows changed; the graph at q = 2..9 went from 1.107-1.152x the
# one-row graph to 1.076-1.117x). Alone, several winners are slower than the configs they beat.
# The 8B qkv then got 48 weight rows per 64-row tile (rows_per_program: 128 programs instead of
# 96, on GPUs with 132 SMs), tune_rows_in_graph.py --spread, 2026-12-06 on an H100: the verify
# graph 0.987-0.997x at every bucket; the gate_up spreads tried (110 rows in 128-row tiles,
# 218 in 256, 56 in 64) tied or lost.
ROWS_CONFIGS: dict[tuple[int, int, int], RowsConfig] = {
    (6144, 4096, 2): RowsConfig("dot", 64, 128, 4, 5, 48),
    (6144, 4096, 4): RowsConfig("dot", 64, 128, 4, 5, 48),
    (6144, 4096, 8): RowsConfig("dot", 64, 128, 4, 5, 48),
    (6144, 4096, 16): RowsConfig("dot", 64, 128, 4, 5, 48),
    (4096, 4096, 2): RowsConfig("dot", 32, 256, 4, 6),
    (4096, 4096, 4): RowsConfig("dot", 32, 256, 4, 6),
    (4096, 4096, 8): RowsConfig("dot", 32, 256, 4, 6),
    (4096, 4096, 16): RowsConfig("dot", 32, 256, 4, 6),
    (28672, 4096, 2): RowsConfig("dot", 64, 128, 4, 3),
    (28672, 4096, 4): RowsConfig("dot", 64, 128, 4, 3),
    (28672, 4096, 8): RowsConfig("dot", 128, 128, 4, 4),
    (28672, 4096, 16): RowsConfig("dot", 128, 128, 4, 4),
    (4096, 14336, 2): RowsConfig("dot", 32, 256, 4, 6),
    (4096, 14336, 4): RowsConfig("dot", 32, 256, 4, 6),
    (4096, 14336, 8): RowsConfig("dot", 32, 256, 4, 6),
    (4096, 14336, 16): RowsConfig("dot", 32, 256, 4, 6),
    (128256, 4096, 2): RowsConfig("dot", 128, 128, 4, 4),
    (128256, 4096, 4): RowsConfig("dot", 128, 128, 4, 4),
    (128256, 4096, 8): RowsConfig("dot", 128, 128, 4, 4),
    (128256, 4096, 16): RowsConfig("dot", 128, 128, 4, 4),
    (3072, 2048, 2): RowsConfig("dot", 32, 256, 4, 6),
    (3072, 2048, 4): RowsConfig("dot", 32, 256, 4, 6),
    (3072, 2048, 8): RowsConfig("dot", 32, 256, 4, 6),
    (3072, 2048, 16): RowsConfig("dot", 32, 256, 4, 6),
    (2048, 2048, 2): RowsConfig("fma", 2, 1024, 4, 4),
    (2048, 2048, 4): RowsConfig("dot", 32, 256, 4, 4),
    (2048, 2048, 8): RowsConfig("dot", 32, 256, 4, 4),
    (2048, 2048, 16): RowsConfig("dot", 32, 256, 4, 4),
    (16384, 2048, 2): RowsConfig("dot", 128, 128, 4, 4),
    (16384, 2048, 4): RowsConfig("dot", 64, 128, 4, 5),
    (16384, 2048, 8): RowsConfig("dot", 128, 128, 4, 4),
    (16384, 2048, 16): RowsConfig("dot", 128, 128, 4, 4),
    (2048, 8192, 2): RowsConfig("fma", 2, 1024, 4, 3),
    (128256, 2048, 2): RowsConfig("dot", 64, 128, 4, 5),
    (128256, 2048, 4): RowsConfig("dot", 32, 256, 4, 4),
    (128256, 2048, 8): RowsConfig("dot", 64, 128, 4, 5),
    (128256, 2048, 16): RowsConfig("dot", 128, 128, 8, 5),
}


def row_bucket(num_rows: int) -> int:
    """The power of two >= num_rows: the BLOCK_M that rows compile for (so one compiled kernel
    serves e.g. M = 5..8, and configs are keyed by it)."""
    return 1 << max(0, num_rows - 1).bit_length()


@functools.cache
def _kernel():
    """Compile-on-demand kernel (triton is imported on first use only, as in triton_ops)."""
    global triton, tl, gemv_jit  # kernels resolve names in this module's globals
    global _accumulate, _weight_rows, _finish
    import triton
    import triton.language as tl

    from specserve.model.layers import gemv_jit

    @triton.jit
    def _weight_rows(t, blk, n_rows, GATE_UP: tl.constexpr, ROWS: tl.constexpr,
                     BLOCK_N: tl.constexpr):
        """Tile row t (0..BLOCK_N-1) of weight-row block blk (ROWS <= BLOCK_N weight rows per
        block) -> (weight row, in range?). GATE_UP: gate and up rows of one activation are
        neighbours (see _gemv_rows)."""
        if GATE_UP:
            act_idx = blk * (ROWS // 2) + t // 2  # gate rows even, up odd
            rows = (t % 2) * (n_rows // 2) + act_idx
            ok = act_idx < n_rows // 2
        else:
            rows = blk * ROWS + t
            ok = rows < n_rows
        if ROWS < BLOCK_N:
            ok = ok & (t < ROWS)
        return rows, ok

    @triton.jit
    def _finish(out, blk, rows, row_mask, m, m_mask, b_ptr, out_ptr, n_rows, stride_o,
                HAS_BIAS: tl.constexpr, GATE_UP: tl.constexpr, ROWS: tl.constexpr,
                BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
        """Store weight-row block blk's float32 sums out [BLOCK_M, BLOCK_N] (+ bias), or with
        GATE_UP its activations silu(gate) * up [BLOCK_M, BLOCK_N / 2] (see _gemv_rows)."""
        HALF_N: tl.constexpr = BLOCK_N // 2
        if HAS_BIAS:
            out += tl.load(b_ptr + rows, mask=row_mask, other=0.0).to(tl.float32)[None, :]
        if GATE_UP:  # [BLOCK_M, BLOCK_N] -> [BLOCK_M, HALF_N] x 2
            sums = out.to(out_ptr.dtype.element_ty).to(tl.float32)
            gate, up = tl.split(tl.reshape(sums, (BLOCK_M, HALF_N, 2)))
            act = (gate / (1.0 + tl.exp(-gate))).to(out_ptr.dtype.element_ty).to(tl.float32)
            idx = blk * (ROWS // 2) + tl.arange(0, HALF_N)
            idx_mask = idx < n_rows // 2
            if ROWS < BLOCK_N:
                idx_mask = idx_mask & (tl.arange(0, HALF_N) < ROWS // 2)
            tl.store(out_ptr + m[:, None] * stride_o + idx[None, :],
                     (act * up).to(out_ptr.dtype.element_ty),
                     mask=m_mask[:, None] & idx_mask[None, :])
        else:
            tl.store(out_ptr + m[:, None] * stride_o + rows[None, :],
                     out.to(out_ptr.dtype.element_ty), mask=m_mask[:, None] & row_mask[None, :])

    @triton.jit
    def _accumulate(acc, w, x_ptrs, x_ok, cols, n_cols, EVEN_COLS: tl.constexpr,
                    MODE: tl.constexpr, PRECISION: tl.constexpr):
        """acc += the products of weight tile w [BLOCK_N, BLOCK_K] (columns cols) with the
        same columns of x's rows through x_ptrs [BLOCK_M, 1] (rows not x_ok and, unless
        EVEN_COLS, columns >= n_cols read as 0); acc is [BLOCK_N, BLOCK_M] ("dot") or
        [BLOCK_M, BLOCK_N, BLOCK_K] ("fma")."""
        if EVEN_COLS:
            x = tl.load(x_ptrs + cols[None, :], mask=x_ok[:, None], other=0.0)
        else:
            x = tl.load(x_ptrs + cols[None, :], mask=x_ok[:, None] & (cols < n_cols)[None, :],
                        other=0.0)
        if MODE == "dot":
            acc = tl.dot(w, tl.trans(x.to(w.dtype)), acc, input_precision=PRECISION)
        else:
            acc += x.to(tl.float32)[:, None, :] * w.to(tl.float32)[None, :, :]
        return acc

    @triton.jit(do_not_specialize=["n_m"])  # one compile serves every M of a bucket
    def _gemv_rows(x_ptr, w_ptr, b_ptr, out_ptr, n_m, n_rows, n_cols, stride_x, stride_w,
                   stride_o, HAS_BIAS: tl.constexpr, EVEN: tl.constexpr,
                   EVEN_COLS: tl.constexpr, MODE: tl.constexpr, GATE_UP: tl.constexpr,
                   PRECISION: tl.constexpr, ROWS: tl.constexpr, BLOCK_M: tl.constexpr,
                   BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PDL: tl.constexpr):
        """out[m, n] = sum_k x[m, k] * w[n, k] (+ b[n]) for ROWS <= BLOCK_N weight rows n per
        program (a [BLOCK_N, BLOCK_K] tile with its rows past ROWS masked) and all
        n_m <= BLOCK_M rows m; MODE is the variant ("dot" or "fma"). EVEN: no weight masks
        (ROWS == BLOCK_N, n_rows % BLOCK_N == 0 and n_cols % BLOCK_K == 0); EVEN_COLS: no
        column masks (n_cols % BLOCK_K == 0). The first BLOCK_K
        columns are peeled off the loop: their weights are loaded before the PDL wait
        (layers/pdl.py), as in triton_ops' one-row _gemv; the sums are the same.

        GATE_UP: w = [gate; up] (n_rows = 2I) and out[m, i] = silu(gate_i . x_m) * (up_i . x_m)
        [n_m, I], as fused_mlp's one-row kernel: tile row r holds weight row
        (r % 2) * I + i0 + r // 2, so each program finishes BLOCK_N / 2 activations itself
        (each sum rounded to out's dtype first, then silu and the product rounded, as
        gemv_rows followed by triton_ops.silu_mul round them)."""
        m = tl.arange(0, BLOCK_M)
        m_mask = m < n_m
        rows, row_mask = _weight_rows(tl.arange(0, BLOCK_N), tl.program_id(0), n_rows, GATE_UP,
                                      ROWS, BLOCK_N)
        x_ptrs = x_ptr + m[:, None] * stride_x  # [BLOCK_M, 1]
        w_rows = w_ptr + rows.to(tl.int64)[:, None] * stride_w  # [BLOCK_N, 1]
        cols = tl.arange(0, BLOCK_K)
        w = gemv_jit.load_weights_then_wait(w_rows, cols, row_mask, n_cols, EVEN, PDL,
                                            EVEN_COLS)
        if MODE == "dot":
            acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
        else:
            acc = tl.zeros((BLOCK_M, BLOCK_N, BLOCK_K), dtype=tl.float32)
        acc = _accumulate(acc, w, x_ptrs, m_mask, cols, n_cols, EVEN_COLS, MODE, PRECISION)
        for k0 in range(BLOCK_K, n_cols, BLOCK_K):
            cols = k0 + tl.arange(0, BLOCK_K)
            w = gemv_jit.weight_tile(w_rows, cols, row_mask, n_cols, EVEN,
                                     EVEN_COLS)  # [BLOCK_N, BLOCK_K]
            acc = _accumulate(acc, w, x_ptrs, m_mask, cols, n_cols, EVEN_COLS, MODE, PRECISION)
        if MODE == "dot":
            out = tl.trans(acc)  # [BLOCK_M, BLOCK_N]
        else:
            out = tl.sum(acc, axis=2)  # [BLOCK_M, BLOCK_N]
        _finish(out, tl.program_id(0), rows, row_mask, m, m_mask, b_ptr, out_ptr, n_rows,
                stride_o, HAS_BIAS, GATE_UP, ROWS, BLOCK_M, BLOCK_N)

    return {"fma": _gemv_rows, "dot": _gemv_rows}


def gemv_rows(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
              config: RowsConfig) -> torch.Tensor:
    """x [M, K] @ weight [N, K].T (+ bias [N]) -> [M, N] in x's dtype, float32 accumulation,
    for 1 <= M <= MAX_ROWS; the weight is read once for all M rows."""
    return _launch(x, weight, bias, config, gate_up=False)


def gate_up_silu_rows(x: torch.Tensor, weight: torch.Tensor, config: RowsConfig) -> torch.Tensor:
    """x [M, K], weight [2I, K] = [gate; up] -> silu(x @ gate.T) * (x @ up.T) [M, I] in x's
    dtype, 1 <= M <= MAX_ROWS, the same bits as triton_ops.silu_mul(gemv_rows(x, weight, None,
    config)) in one kernel (config.pairs_rows: gate and up rows in pairs)."""
    assert weight.shape[0] % 2 == 0 and config.pairs_rows
    return _launch(x, weight, None, config, gate_up=True)


def _launch(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
            config: RowsConfig, gate_up: bool) -> torch.Tensor:
    (num_m, n_cols), n_rows = x.shape, weight.shape[0]
    assert 1 <= num_m <= MAX_ROWS and config.variant in VARIANTS
    assert x.stride(-1) == 1 and weight.stride(-1) == 1 and weight.shape[1] == n_cols
    block_m = row_bucket(num_m)
    if config.variant != "fma":  # tl.dot tiles
        block_m = max(block_m, MIN_DOT_ROWS)
    rows = config.rows_per_program or config.block_n  # weight rows per program
    assert 1 <= rows <= config.block_n
    out_cols = n_rows // 2 if gate_up else n_rows
    out = torch.empty(num_m, out_cols, dtype=x.dtype, device=x.device)  # [M, N] or [M, I]
    # gate_up: a program covers rows / 2 activations, so the weight is even when I is
    per_program = rows // 2 if gate_up else rows
    even_cols = n_cols % config.block_k == 0
    even = rows == config.block_n and out_cols % per_program == 0 and even_cols
    n_blocks = (out_cols + per_program - 1) // per_program
    common = dict(HAS_BIAS=bias is not None, EVEN=even, EVEN_COLS=even_cols, GATE_UP=gate_up,
                  PRECISION="ieee" if x.dtype == torch.float32 else "tf32", ROWS=rows,
                  BLOCK_M=block_m,
                  BLOCK_N=config.block_n, BLOCK_K=config.block_k, num_warps=config.num_warps,
                  num_stages=config.num_stages, **pdl.launch_options(x))
    args = (x, weight, bias if bias is not None else weight, out, num_m, n_rows, n_cols,
            x.stride(0), weight.stride(0), out.stride(0))
    _kernel()[config.variant][(n_blocks,)](*args, MODE=config.variant, **common)
    return out
