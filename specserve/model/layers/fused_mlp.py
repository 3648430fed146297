"""Gate/up projection with SiLU-and-multiply in its epilogue (batch-1 decode and verification
on CUDA).

Why: at one row the gated MLP was three kernels, the gate_up GEMV, silu_mul and the down GEMV,
and silu_mul moved almost no bytes: its cost was a launch and a ramp (~2-3 us, 32 times a step
on an 8B model). Here each GEMV program computes the gate rows AND the matching up rows, so it
can finish silu(gate) * up itself and write the [1, I] activation the down projection reads.

Why the epilogue rather than the down projection's prologue: there every program would have to
recompute silu over the whole [2I] vector (thousands of programs x exp + divide per element)
and re-read it from L2; here each activation is computed once, by the program that already holds
its two sums.

Numerics are the unfused path's exactly: each sum is float32 over the same tile shape as
triton_ops.gemv (gate/up rows interleaved, so the tile is the GEMV's [BLOCK_N, BLOCK_K]) and is
rounded to the output dtype, as gemv stores it; then silu in float32 rounded, the product rounded
(triton_ops._silu_mul_kernel). Only on the path triton_ops.linear would give the GEMV: one
bf16/fp16 row on CUDA, a plain Linear without bias, a shape listed in GATE_UP_CONFIGS.

The 2..16 rows of a batch-1 verification step get the same epilogue in the multi-row GEMV
(gemv.gate_up_silu_rows, with that shape's gemv.ROWS_CONFIGS), where triton_ops.linear would
give gemv_rows; silu_mul_of_linear picks between the two.
"""

from __future__ import annotations

import functools

import torch

from specserve.model.layers import gemv, pdl, triton_ops

#: Module-level switches (A/B timing in tests/gpu/check_fused_decode.py); off = the unfused path.
ENABLED = True  # both paths
ROWS_ENABLED = True  # the multi-row path (gemv.gate_up_silu_rows) only

# Packed gate_up weight shape (2I, K) -> (BLOCK_N rows per program, gate and up interleaved, so
# BLOCK_N / 2 activations; BLOCK_K; num_warps; num_stages). Taken from triton_ops.GEMV_CONFIGS
# for the same shapes (Llama-3-8B, Llama-3.2-1B), so each program streams what a gate_up GEMV
# program did.
GATE_UP_CONFIGS: dict[tuple[int, int], tuple[int, int, int, int]] = {
    (28672, 4096): (2, 2048, 8, 1),
    (16384, 2048): (16, 512, 4, 1),
}


@functools.cache
def _kernel():
    """Compiled on first use (CPU runs never import triton)."""
    global triton, tl, gemv_jit
    import triton
    import triton.language as tl

    from specserve.model.layers import gemv_jit

    @triton.jit
    def _gate_up_silu(x_ptr, w_ptr, out_ptr, inter, n_cols, stride_w, EVEN: tl.constexpr,
                      BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PDL: tl.constexpr):
        """out[i] = silu(w[i] . x) * (w[inter + i] . x) for BLOCK_N / 2 values of i per
        program. Tile row r holds weight row (r % 2) * inter + i0 + r // 2: gate and up of one
        activation are neighbours, so the row sums reshape to [BLOCK_N / 2, 2] and split.
        The sums are triton_ops' _gemv's (gemv_jit.one_row_sums)."""
        HALF_N: tl.constexpr = BLOCK_N // 2
        r = tl.arange(0, BLOCK_N)
        act_idx = tl.program_id(0) * HALF_N + r // 2  # [BLOCK_N]
        row_mask = act_idx < inter
        rows = (r % 2) * inter + act_idx  # gate rows even, up rows odd
        w_rows = w_ptr + rows.to(tl.int64)[:, None] * stride_w
        sums = gemv_jit.one_row_sums(x_ptr, w_rows, row_mask, n_cols, EVEN, BLOCK_K, PDL)
        # The GEMV's output rounding, then silu_mul's: [BLOCK_N] -> [HALF_N] x 2
        sums = sums.to(out_ptr.dtype.element_ty).to(tl.float32)
        gate, up = tl.split(tl.reshape(sums, (HALF_N, 2)))  # [HALF_N] each
        act = (gate / (1.0 + tl.exp(-gate))).to(out_ptr.dtype.element_ty).to(tl.float32)
        idx = tl.program_id(0) * HALF_N + tl.arange(0, HALF_N)
        tl.store(out_ptr + idx, (act * up).to(out_ptr.dtype.element_ty), mask=idx < inter)

    return _gate_up_silu


def gate_up_silu(x: torch.Tensor, weight: torch.Tensor,
                 config: tuple[int, int, int, int]) -> torch.Tensor:
    """x [1, K], weight [2I, K] = [gate; up] -> silu(x @ gate.T) * (x @ up.T) [1, I] in x's
    dtype; config = (BLOCK_N (even), BLOCK_K, num_warps, num_stages)."""
    (_, n_cols), (n_rows, _) = x.shape, weight.shape
    assert x.stride(-1) == 1 and weight.stride(-1) == 1 and weight.shape[1] == n_cols
    assert n_rows % 2 == 0
    block_n, block_k, warps, stages = config
    assert block_n % 2 == 0 and block_n >= 2
    inter = n_rows // 2
    out = torch.empty(1, inter, dtype=x.dtype, device=x.device)
    even = inter % (block_n // 2) == 0 and n_cols % block_k == 0
    _kernel()[(triton.cdiv(inter, block_n // 2),)](
        x, weight, out, inter, n_cols, weight.stride(0), EVEN=even, BLOCK_N=block_n,
        BLOCK_K=block_k, num_warps=warps, num_stages=stages, **pdl.launch_options(x))
    return out


def config_for(layer: torch.nn.Linear, x: torch.Tensor) -> tuple[int, int, int, int] | None:
    """The kernel config when gate_up_silu should serve silu_mul(layer(x)), else None: the
    switch is on and triton_ops.linear would take its one-row GEMV for this call (one bf16/fp16
    row on CUDA, a plain Linear), without bias, for a listed shape."""
    if not (x.dim() == 2 and x.shape[0] == 1 and _kernel_path(layer, x)):
        return None
    return GATE_UP_CONFIGS.get(tuple(layer.weight.shape))


def rows_config_for(layer: torch.nn.Linear, x: torch.Tensor) -> gemv.RowsConfig | None:
    """The multi-row config when gemv.gate_up_silu_rows should serve silu_mul(layer(x)), else
    None: 2..MAX_ROWS rows (a batch-1 verification step) that triton_ops.linear would send to
    gemv_rows, without bias. Why: there silu_mul was a kernel of its own per layer (32
    launches per step on an 8B model, ~48 us without PDL). On an H200 with PDL the fused
    kernel measured no faster (BENCHMARKS.md, "H200, session 12"): it gives the same bits
    with fewer launches, which counts on GPUs without PDL."""
    if not (ROWS_ENABLED and x.dim() == 2 and 2 <= x.shape[0] <= gemv.MAX_ROWS
            and _kernel_path(layer, x)):
        return None
    config = gemv.ROWS_CONFIGS.get((*layer.weight.shape, gemv.row_bucket(x.shape[0])))
    return config if config is not None and config.pairs_rows else None


def _kernel_path(layer: torch.nn.Linear, x: torch.Tensor) -> bool:
    """The switch is on and triton_ops.linear's kernels would serve layer(x): bf16/fp16 on CUDA,
    a plain Linear without bias, contiguous last dimensions."""
    return (ENABLED and x.dtype in (torch.bfloat16, torch.float16) and triton_ops.available(x)
            and type(layer).forward is torch.nn.Linear.forward and layer.bias is None
            and x.stride(-1) == 1 and layer.weight.dtype == x.dtype
            and layer.weight.stride(-1) == 1 and layer.weight.shape[0] % 2 == 0)


def silu_mul_of_linear(layer: torch.nn.Linear, x: torch.Tensor) -> torch.Tensor | None:
    """silu(gate) * up of layer(x) = [gate | up] in one kernel where one serves this call
    (config_for, rows_config_for), else None (the caller runs the projection and silu_mul)."""
    config = config_for(layer, x)
    if config is not None:
        return gate_up_silu(x, layer.weight, config)  # [1, I]
    rows_config = rows_config_for(layer, x)
    if rows_config is not None:
        return gemv.gate_up_silu_rows(x, layer.weight, rows_config)  # [M, I]
    return None
