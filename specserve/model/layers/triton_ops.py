"""Fused Triton kernels for the small per-layer ops of a CUDA decode step.

Why: with CUDA graphs a decode step of an 8B model is bound by its ~1000 kernels, not by Python;
at batch 1 every RMSNorm was 7 tiny kernels (8 with the residual add before it) (float, pow, mean, add, rsqrt, mul, cast + the
weight multiply) and every rotary embedding 6, each costing a few microseconds of launch and
ramp while moving almost no bytes. One program per token does each in a single kernel.

Numerics follow the torch reference (layers/norm.py, layers/rotary.py): RMSNorm normalises in
float32, casts to the input dtype, then multiplies by the weight in that dtype; rotary works in
float32 and casts back. Only the order of the float32 reductions/FMAs differs, so results can
differ from the torch path in the last bit. The CPU path keeps the torch code; the kernels run
on CPU only under TRITON_INTERPRET=1 (tests).
"""

from __future__ import annotations

import functools
import importlib.util

import torch

from specserve.model.layers import gemv as multirow
from specserve.model.layers import pdl

MAX_FUSED_HIDDEN = 16384  # one program holds a whole row in registers up to this width


def available(x: torch.Tensor) -> bool:
    """True when the fused kernels should serve x: a CUDA tensor, and triton is installed.
    (Checked without importing triton: CPU runs never import it, which keeps the interpreter
    choice of the kernel tests free.)"""
    return x.is_cuda and _has_triton()


@functools.cache
def _has_triton() -> bool:
    return importlib.util.find_spec("triton") is not None


def _pow2(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


@functools.cache
def _kernels():
    """Compile-on-demand kernel definitions (triton is imported on first use only). The
    kernels resolve ``tl`` from this module's globals, hence the global import."""
    global triton, tl, pdl_jit
    import triton
    import triton.language as tl

    from specserve.model.layers import pdl_jit

    @triton.jit
    def _rms_norm_kernel(x_ptr, w_ptr, out_ptr, stride_x, stride_o, n_cols, eps,
                         BLOCK: tl.constexpr, PDL: tl.constexpr):
        pdl_jit.release_and_wait(PDL)  # layers/pdl.py
        row = tl.program_id(0).to(tl.int64)
        cols = tl.arange(0, BLOCK)
        mask = cols < n_cols
        x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
        var = tl.sum(x * x, axis=0) / n_cols
        y = (x * tl.math.rsqrt(var + eps)).to(out_ptr.dtype.element_ty)
        w = tl.load(w_ptr + cols, mask=mask, other=0.0)
        out = w.to(tl.float32) * y.to(tl.float32)
        tl.store(out_ptr + row * stride_o + cols, out.to(out_ptr.dtype.element_ty), mask=mask)

    @triton.jit
    def _add_rms_norm_kernel(x_ptr, r_ptr, w_ptr, out_ptr, res_ptr, stride_x, stride_r,
                             stride_o, stride_res, n_cols, eps, BLOCK: tl.constexpr,
                             PDL: tl.constexpr):
        """res = x + r rounded to the residual dtype (as torch's add), out = RMSNorm(res)."""
        pdl_jit.release_and_wait(PDL)  # layers/pdl.py
        row = tl.program_id(0).to(tl.int64)
        cols = tl.arange(0, BLOCK)
        mask = cols < n_cols
        x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
        r = tl.load(r_ptr + row * stride_r + cols, mask=mask, other=0.0).to(tl.float32)
        h = (x + r).to(res_ptr.dtype.element_ty)
        tl.store(res_ptr + row * stride_res + cols, h, mask=mask)
        h = h.to(tl.float32)
        var = tl.sum(h * h, axis=0) / n_cols
        y = (h * tl.math.rsqrt(var + eps)).to(out_ptr.dtype.element_ty)
        w = tl.load(w_ptr + cols, mask=mask, other=0.0)
        out = w.to(tl.float32) * y.to(tl.float32)
        tl.store(out_ptr + row * stride_o + cols, out.to(out_ptr.dtype.element_ty), mask=mask)

    @triton.jit
    def _rotary_kernel(x_ptr, cos_ptr, sin_ptr, out_ptr, stride_xt, stride_xh, stride_ot,
                       stride_oh, stride_ct, stride_st, num_heads,
                       HALF: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr):
        """x [T, heads, 2 * HALF] ("rotate half" layout) -> out, one program per token.
        cos [T, HALF]; sin [T, 2, HALF] holding (-sin, +sin)."""
        t = tl.program_id(0).to(tl.int64)
        h = tl.arange(0, BLOCK_H)
        d = tl.arange(0, BLOCK_D)
        d_ok = d < HALF
        mask = (h < num_heads)[:, None] & d_ok[None, :]
        x_row = x_ptr + t * stride_xt + h[:, None] * stride_xh + d[None, :]
        x1 = tl.load(x_row, mask=mask, other=0.0).to(tl.float32)  # [H, HALF]
        x2 = tl.load(x_row + HALF, mask=mask, other=0.0).to(tl.float32)
        c = tl.load(cos_ptr + t * stride_ct + d, mask=d_ok, other=0.0)[None, :]
        s_lo = tl.load(sin_ptr + t * stride_st + d, mask=d_ok, other=0.0)[None, :]  # -sin
        s_hi = tl.load(sin_ptr + t * stride_st + HALF + d, mask=d_ok, other=0.0)[None, :]
        o_row = out_ptr + t * stride_ot + h[:, None] * stride_oh + d[None, :]
        tl.store(o_row, (x1 * c + x2 * s_lo).to(out_ptr.dtype.element_ty), mask=mask)
        tl.store(o_row + HALF, (x2 * c + x1 * s_hi).to(out_ptr.dtype.element_ty), mask=mask)

    @triton.jit
    def _silu_mul_kernel(x_ptr, out_ptr, stride_x, stride_o, inter, BLOCK: tl.constexpr,
                         PDL: tl.constexpr):
        """x [T, 2 * inter] = [gate | up] -> out [T, inter] = silu(gate) * up, rounded like
        torch (silu in float32 rounded to x's dtype, then the product rounded)."""
        pdl_jit.release_and_wait(PDL)  # layers/pdl.py
        t = tl.program_id(0).to(tl.int64)
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        mask = cols < inter
        g = tl.load(x_ptr + t * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
        u = tl.load(x_ptr + t * stride_x + inter + cols, mask=mask, other=0.0).to(tl.float32)
        act = (g / (1.0 + tl.exp(-g))).to(out_ptr.dtype.element_ty).to(tl.float32)
        tl.store(out_ptr + t * stride_o + cols, (act * u).to(out_ptr.dtype.element_ty),
                 mask=mask)

    return _rms_norm_kernel, _rotary_kernel, _silu_mul_kernel, _add_rms_norm_kernel


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x [T, hidden] -> [T, hidden] in x's dtype (weight in x's dtype, as the module keeps it)."""
    num_rows, hidden = x.shape
    assert hidden <= MAX_FUSED_HIDDEN and weight.shape == (hidden,)
    x = x if x.stride(-1) == 1 else x.contiguous()
    out = torch.empty_like(x, memory_format=torch.contiguous_format)
    if num_rows:
        block = _pow2(hidden)
        _kernels()[0][(num_rows,)](x, weight, out, x.stride(0), out.stride(0), hidden, eps,
                                      BLOCK=block, num_warps=min(16, max(1, block // 512)),
                                      **pdl.launch_options(x))
    return out


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                 eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """x, residual [T, hidden] -> (RMSNorm(x + residual), x + residual), both [T, hidden].

    Why: a decoder layer adds each sublayer's output to the residual stream and normalises
    the sum right away; one kernel reads x and residual once and writes both results, where
    the unfused path pays an add kernel plus a second read of the sum (vLLM fuses the same)."""
    num_rows, hidden = x.shape
    assert hidden <= MAX_FUSED_HIDDEN and weight.shape == (hidden,)
    assert residual.shape == x.shape
    x = x if x.stride(-1) == 1 else x.contiguous()
    residual = residual if residual.stride(-1) == 1 else residual.contiguous()
    out = torch.empty_like(x, memory_format=torch.contiguous_format)
    new_residual = torch.empty_like(residual, memory_format=torch.contiguous_format)
    if num_rows:
        block = _pow2(hidden)
        _kernels()[3][(num_rows,)](x, residual, weight, out, new_residual, x.stride(0),
                                   residual.stride(0), out.stride(0), new_residual.stride(0),
                                   hidden, eps, BLOCK=block,
                                   num_warps=min(16, max(1, block // 512)),
                                   **pdl.launch_options(x))
    return out, new_residual


def rotary(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    """x [T, heads, D] (last dim contiguous) -> rotated copy [T, heads, D]; cos [T, ..., D/2]
    and signed_sin [T, ..., 2, D/2] as RotaryTable holds them (contiguous per token)."""
    num_tokens, heads, head_dim = x.shape
    half = head_dim // 2
    assert x.stride(-1) == 1
    out = torch.empty(num_tokens, heads, head_dim, dtype=x.dtype, device=x.device)
    if num_tokens:
        cos = cos.reshape(num_tokens, half)
        sin = signed_sin.reshape(num_tokens, 2 * half)
        _kernels()[1][(num_tokens,)](x, cos, sin, out, x.stride(0), x.stride(1), out.stride(0),
                                      out.stride(1), cos.stride(0), sin.stride(0), heads,
                                      HALF=half, BLOCK_H=_pow2(heads), BLOCK_D=_pow2(half),
                                      num_warps=4)
    return out


SILU_BLOCK = 1024


def silu_mul(x: torch.Tensor) -> torch.Tensor:
    """x [T, 2 * I] = [gate | up] (last dim contiguous) -> silu(gate) * up [T, I]."""
    num_tokens, width = x.shape
    inter = width // 2
    assert x.stride(-1) == 1
    out = torch.empty(num_tokens, inter, dtype=x.dtype, device=x.device)
    if num_tokens:
        grid = (num_tokens, (inter + SILU_BLOCK - 1) // SILU_BLOCK)
        _kernels()[2][grid](x, out, x.stride(0), out.stride(0), inter, BLOCK=SILU_BLOCK,
                            num_warps=4, **pdl.launch_options(x))
    return out


# ---- one-row matrix-vector product ---------------------------------------------------------------
# (BLOCK_N, BLOCK_K, num_warps, num_stages) per weight shape (N, K): the fastest of 60
# configurations for the Llama-3-8B and Llama-3.2-1B projections and lm_heads on an H200 (each
# 5-31% faster alone than cuBLAS, which launches too few blocks for the smaller projections:
# 1.8-2.2 TB/s of ~4.2 on the 4096- and 6144-row ones). Shapes not listed keep cuBLAS: the
# kernel has been measured on these only.
GEMV_CONFIGS: dict[tuple[int, int], tuple[int, int, int, int]] = {
    (6144, 4096): (2, 2048, 8, 3), (4096, 4096): (2, 2048, 8, 3),
    (28672, 4096): (2, 2048, 8, 1), (4096, 14336): (2, 2048, 8, 3),
    (128256, 4096): (2, 2048, 8, 1), (3072, 2048): (2, 2048, 8, 1),
    (2048, 2048): (2, 2048, 8, 1), (16384, 2048): (16, 512, 4, 1),
    (2048, 8192): (2, 2048, 4, 3), (128256, 2048): (2, 1024, 4, 3),
}


@functools.cache
def _gemv_kernel():
    global triton, tl, gemv_jit
    import triton
    import triton.language as tl

    from specserve.model.layers import gemv_jit

    @triton.jit
    def _gemv(x_ptr, w_ptr, b_ptr, out_ptr, n_rows, n_cols, stride_w, HAS_BIAS: tl.constexpr,
              EVEN: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
              PDL: tl.constexpr):
        """out[n] = sum_k w[n, k] * x[k] (+ b[n]): BLOCK_N rows per program, float32 sums
        (gemv_jit.one_row_sums: its first weights load before the PDL wait)."""
        rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
        row_mask = rows < n_rows
        w_rows = w_ptr + rows.to(tl.int64)[:, None] * stride_w
        out = gemv_jit.one_row_sums(x_ptr, w_rows, row_mask, n_cols, EVEN, BLOCK_K, PDL)
        if HAS_BIAS:
            out += tl.load(b_ptr + rows, mask=row_mask, other=0.0).to(tl.float32)
        tl.store(out_ptr + rows, out.to(out_ptr.dtype.element_ty), mask=row_mask)

    return _gemv


def gemv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
         config: tuple[int, int, int, int]) -> torch.Tensor:
    """x [1, K] @ weight[N, K].T (+ bias) -> [1, N] in x's dtype, float32 accumulation;
    config = (BLOCK_N, BLOCK_K, num_warps, num_stages)."""
    (_, n_cols), n_rows = x.shape, weight.shape[0]
    assert x.stride(-1) == 1 and weight.stride(-1) == 1 and weight.shape[1] == n_cols
    block_n, block_k, warps, stages = config
    out = torch.empty(1, n_rows, dtype=x.dtype, device=x.device)
    even = n_rows % block_n == 0 and n_cols % block_k == 0
    _gemv_kernel()[(triton.cdiv(n_rows, block_n),)](
        x, weight, bias if bias is not None else weight, out, n_rows, n_cols, weight.stride(0),
        HAS_BIAS=bias is not None, EVEN=even, BLOCK_N=block_n, BLOCK_K=block_k,
        num_warps=warps, num_stages=stages, **pdl.launch_options(x))
    return out


def linear(layer: torch.nn.Linear, x: torch.Tensor) -> torch.Tensor:
    """layer(x); 1..MAX_ROWS bf16/fp16 rows on CUDA (batch-1 decode and verification) go
    through a Triton GEMV when the layer's shape has a config: one row through ``gemv``
    (GEMV_CONFIGS), 2..16 rows through layers/gemv.py's ``gemv_rows`` (its ROWS_CONFIGS, per
    row bucket).

    Why: at a few rows a projection only streams its weight, and cuBLAS's kernels for these
    shapes leave bandwidth unused (on an H200 the batch-1 Llama-3-8B decode graph went from
    4.64 to 4.29 ms with the one-row kernel; the multi-row one keeps a k+1-row verification
    step near that cost). Sums run in another order than cuBLAS's, so logits can differ from
    a product of a different row count in the last bf16 bit."""
    num_rows = x.shape[0]
    if (x.dim() == 2 and 1 <= num_rows <= multirow.MAX_ROWS
            and x.dtype in (torch.bfloat16, torch.float16) and available(x)
            and type(layer).forward is torch.nn.Linear.forward and x.stride(-1) == 1
            and layer.weight.dtype == x.dtype and layer.weight.stride(-1) == 1):
        shape = tuple(layer.weight.shape)
        if num_rows == 1:
            config = GEMV_CONFIGS.get(shape)
            if config is not None:
                return gemv(x, layer.weight, layer.bias, config)
        else:
            rows_config = multirow.ROWS_CONFIGS.get((*shape, multirow.row_bucket(num_rows)))
            if rows_config is not None:
                return multirow.gemv_rows(x, layer.weight, layer.bias, rows_config)
    return layer(x)
