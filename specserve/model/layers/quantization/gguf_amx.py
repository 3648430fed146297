"""GGUF blocks repacked for the AMX kernel (csrc/gguf_amx_linear.cpp): the ``gguf`` method's
float32 products on Intel AMX tiles, where the CPU has them.

Why: the AVX-512 kernel (gguf_linear.cpp) pays 2 float32 FMAs per row of x per 32 weights, so
past a few rows it is bound by FMAs (batch-32 decoding, long verifications, prompts). An AMX
tile multiply takes up to 5 rows of x (each split exactly into 3 bfloat16 parts) for the price of
one; what remains per block is decoding it and folding each job's sums (its scales differ per
output). Measured on a 2-core Xeon: about the AVX-512 kernel's cost at 1-6 rows, 1.3-1.8x less at
9-32 (BENCHMARKS.md "CPU, session 27").
Results are the same float32 model's (see the kernel's header for why the split is exact): a
different summation order from the AVX-512 kernel, as between any two GEMM kernels.

Precision: under torch.set_float32_matmul_precision("high") or ("medium") the kernel keeps 2 or
1 bfloat16 parts of x (PyTorch's own meaning of those settings) in the products with the codes
(the block minimum's term keeps x exactly), and a tile job then takes 8 or 16 rows: a
verification of up to 7 or 15 proposals costs one job. torch's default ("highest") stays exact.
A row's bits still depend only on that row, so speculation stays exactly lossless against plain
decoding at the same setting; against the float32 model (transformers) tokens can differ.

Layout: the kernel's B tile wants, for 16 output features side by side, pairs of consecutive
inputs ("VNNI" pairs): tile row kp, word 2n + j = the code of input 2kp + j of weight row n. The
blocks are repacked once at load into groups of 16 weight rows, [N / 16, K / 32, record], the
same bytes per weight as the file.
"""

from __future__ import annotations

import os
from collections.abc import Callable

import torch

LANES = 16  # weight rows per packed group: the float32 columns of a tile
DISABLE_ENV = "SPECSERVE_AMX"  # "0": keep the AVX-512 kernel even where AMX is there


def wanted(kernels) -> bool:
    """Whether GGUF products should run on AMX tiles: the kernels are built with AMX, Linux
    granted this process the tile state, and SPECSERVE_AMX is not "0"."""
    return (kernels is not None and os.environ.get(DISABLE_ENV, "1") != "0"
            and bool(kernels.amx_ready()))


# torch.get_float32_matmul_precision() -> bfloat16 parts of each x, and the layer's format suffix.
# "highest" (torch's default) keeps x exactly; "high" is PyTorch's "each float32 number as the sum
# of two bfloat16 numbers" (~16 significant bits); "medium" rounds x to bfloat16.
PARTS_BY_PRECISION = {"highest": 3, "high": 2, "medium": 1}
FORMAT_SUFFIX = {3: "+amx", 2: "+amx/bf16x2", 1: "+amx/bf16"}


def parts_for_precision(precision: str | None = None) -> int:
    """bfloat16 parts per x for a float32 matmul precision (default: torch's current setting).

    Why follow torch's setting: it is the switch PyTorch users already have for trading float32
    matmul precision for speed, with this very meaning on CPUs with AMX. Fewer parts fit more
    rows of x in one tile job (3 parts: 5 rows, 2: 8, 1: 16), so longer verifications stay at one
    job's cost."""
    precision = precision or torch.get_float32_matmul_precision()
    if precision not in PARTS_BY_PRECISION:
        raise ValueError(f"float32 matmul precision {precision!r} is not one of "
                         f"{sorted(PARTS_BY_PRECISION)}")
    return PARTS_BY_PRECISION[precision]


def kernel(kernels, format_name: str, out_features: int, parts: int = 3
           ) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    """x [T, K] float32 (as `parts` bfloat16 parts), packed records -> [T, out_features], through
    the AMX kernel."""
    fn = getattr(kernels, f"{format_name.lower()}_amx_linear")

    def amx_kernel(x: torch.Tensor, packed: torch.Tensor) -> torch.Tensor:
        return fn(x, packed, out_features, parts)

    return amx_kernel


def _groups(blocks: torch.Tensor, block_bytes: int) -> torch.Tensor:
    """[N, K / 32 * block_bytes] -> [N / 16, 16, K / 32, block_bytes] (N a multiple of 16)."""
    n = blocks.shape[0]
    if n % LANES:
        raise ValueError(f"AMX packing needs a multiple of {LANES} output features, got {n}")
    return blocks.view(n // LANES, LANES, -1, block_bytes)


def _tile_rows(codes: torch.Tensor) -> torch.Tensor:
    """codes [G, 16 rows n, B, 32 inputs] -> [G, B, 16 tile rows kp, 32 words 2n + j]."""
    g, lanes, b, _ = codes.shape
    return codes.view(g, lanes, b, 16, 2).permute(0, 2, 3, 1, 4).reshape(g, b, 16, 2 * lanes)


def _scales(g: torch.Tensor, offset: int) -> torch.Tensor:
    """The 16 rows' float16 field at byte offset of each block: [G, B, 32 bytes]."""
    field = g[..., offset:offset + 2].permute(0, 2, 1, 3)  # [G, B, 16, 2]
    return field.reshape(*field.shape[:2], 2 * LANES)


def pack_q4_1(blocks: torch.Tensor) -> torch.Tensor:
    """GGUF Q4_1 rows [N, K / 32 * 20] -> records [N / 16, K / 32, 320]: 4 chunks of 32 16-bit
    words (word w of chunk c = word w of tile rows 4c..4c+3 in its four nibbles, lowest first),
    16 x f16 d, 16 x f16 m."""
    g = _groups(blocks, 20)  # [G, 16, B, 20]
    raw = g[..., 4:]  # [G, 16, B, 16]: byte j holds input j (low nibble), 16 + j (high)
    codes = torch.cat([raw & 15, raw >> 4], dim=-1)  # [G, 16, B, 32] inputs in order
    rows = _tile_rows(codes).to(torch.int32)  # [G, B, 16, 32]
    quads = rows.view(*rows.shape[:2], 4, 4, 32)  # [G, B, chunk, row in chunk, word]
    words = (quads[:, :, :, 0] | quads[:, :, :, 1] << 4 | quads[:, :, :, 2] << 8
             | quads[:, :, :, 3] << 12).to(torch.int16)  # [G, B, 4, 32]
    chunks = words.contiguous().view(torch.uint8)  # [G, B, 4, 64] little-endian words
    rec = torch.cat([chunks.reshape(*chunks.shape[:2], 256), _scales(g, 0), _scales(g, 2)],
                    dim=-1)
    return rec.contiguous()


def pack_q8_0(blocks: torch.Tensor) -> torch.Tensor:
    """GGUF Q8_0 rows [N, K / 32 * 34] -> records [N / 16, K / 32, 544]: 16 tile rows of 32
    int8 codes, then 16 x f16 d."""
    g = _groups(blocks, 34)  # [G, 16, B, 34]
    rows = _tile_rows(g[..., 2:])  # [G, B, 16, 32]
    rec = torch.cat([rows.reshape(*rows.shape[:2], 512), _scales(g, 0)], dim=-1)
    return rec.contiguous()


PACKERS = {"Q4_1": pack_q4_1, "Q8_0": pack_q8_0}
