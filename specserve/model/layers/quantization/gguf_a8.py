"""GGUF blocks times 8-bit activations: ``quantization="gguf_a8"`` (CPU, opt-in).

Why: ``gguf`` (gguf_blocks.py) multiplies the file's blocks by float32 activations and gives the
dequantized model's float32 results, but every row of x costs float32 FMAs: on the 2-core CI
CPU a verification pass of 6 rows costs ~2x a decode pass, which caps what speculation can gain
there. llama.cpp, and vLLM's GGUF matrix-vector kernels, round the activations to 8 bits per
32-value block and use integer dot products; this method does the same with AVX-512 VNNI
(csrc/gguf_a8_linear.cpp), where a row of x costs a quarter of the multiply-add instructions.

What changes: each block of 32 inputs is replaced by dx * round(x / dx), dx = max|x| / 127,
before the product (per row, never per batch: a row's result does not depend on its batch
mates, so speculative verification still equals plain decoding token for token). The model is
then no longer the dequantized float32 model: greedy output can part from transformers' where two
tokens are nearly tied, as llama.cpp's does. Hence opt-in; ``gguf`` stays the default.

Layout: the kernel wants 16 output features side by side in the 16 lanes of a vector, so the
blocks are repacked once at load into groups of 16 weight rows (same bytes per weight: 20 per
32 Q4_1 values, 36 per 32 Q8_0 values, the extra 2 being the codes' sum).
"""

from __future__ import annotations

import logging
from typing import ClassVar

import torch
from torch import nn

from specserve.model.layers.quantization.gguf_blocks import GGUFBlockLinear, GGUFBlocks

logger = logging.getLogger(__name__)

LANES = 16  # weight rows per packed group: one int32 lane each


def _groups(blocks: torch.Tensor, block_bytes: int) -> torch.Tensor:
    """[N, K / 32 * block_bytes] -> [N / 16 (rounded up), 16, K / 32, block_bytes], zero rows
    padding the last group."""
    n = blocks.shape[0]
    per_row = blocks.view(n, -1, block_bytes)  # [N, B, bytes]
    pad = (-n) % LANES
    if pad:
        per_row = torch.cat([per_row, per_row.new_zeros(pad, *per_row.shape[1:])])
    return per_row.view(-1, LANES, per_row.shape[1], block_bytes)


def pack_q4_1(blocks: torch.Tensor) -> torch.Tensor:
    """GGUF Q4_1 rows [N, K / 32 * 20] -> records [N / 16, K / 32, 320] (see gguf_a8_linear.cpp).

    A file byte j of a block holds input j (low nibble) and input 16 + j (high nibble), so chunk
    p of a record is just bytes 4p..4p+3 of each of the 16 rows, side by side."""
    g = _groups(blocks, 20)  # [G, 16, B, 20]
    codes = g[..., 4:].reshape(*g.shape[:3], 4, 4).permute(0, 2, 3, 1, 4)  # [G, B, p, 16, 4]
    d = g[..., 0:2].permute(0, 2, 1, 3)  # [G, B, 16, 2] float16 bytes
    m = g[..., 2:4].permute(0, 2, 1, 3)
    rec = torch.cat([codes.reshape(*codes.shape[:2], 256), d.reshape(*d.shape[:2], 32),
                     m.reshape(*m.shape[:2], 32)], dim=-1)
    return rec.contiguous()


def pack_q8_0(blocks: torch.Tensor) -> torch.Tensor:
    """GGUF Q8_0 rows [N, K / 32 * 34] -> records [N / 16, K / 32, 576]: 8 chunks of 4 codes
    per row, the 16 scales, and each row's int16 sum of codes."""
    g = _groups(blocks, 34)  # [G, 16, B, 34]
    codes = g[..., 2:].reshape(*g.shape[:3], 8, 4).permute(0, 2, 3, 1, 4)  # [G, B, p, 16, 4]
    d = g[..., 0:2].permute(0, 2, 1, 3)  # [G, B, 16, 2]
    sums = g[..., 2:].contiguous().view(torch.int8).sum(-1, dtype=torch.int16)  # [G, 16, B]
    sums = sums.permute(0, 2, 1).contiguous().view(torch.uint8)  # [G, B, 32]
    rec = torch.cat([codes.reshape(*codes.shape[:2], 512), d.reshape(*d.shape[:2], 32), sums],
                    dim=-1)
    return rec.contiguous()


PACKERS = {"Q4_1": pack_q4_1, "Q8_0": pack_q8_0}


class GGUFBlocksA8(GGUFBlocks):
    """``gguf`` with 8-bit activations: the same GGUF blocks, repacked, through the VNNI kernel."""

    name: ClassVar[str] = "gguf_a8"
    description: ClassVar[str] = ("keep a GGUF file's Q4_1 / Q8_0 blocks and round activations to "
                                  "8 bits per 32 values for integer dot products (as llama.cpp); "
                                  "CPU, float32 model, opt-in")

    def bind(self, model: nn.Module, source) -> None:
        super().bind(model, source)
        if self._kernels is None:  # every layer then keeps its dequantized float32 weight
            logger.warning("quantization='gguf_a8' needs specserve's CPU kernels, which are off "
                           "or did not build: the model runs on its dequantized float32 "
                           "weights instead")

    def _block_linear(self, linear: nn.Linear, blocks: torch.Tensor, format_name: str,
                      tied: bool, role: str) -> GGUFBlockLinear:
        """The layer over the blocks repacked for the VNNI kernel (see PACKERS), whatever its
        role (no greedy screen: these products are not the AMX kernel's)."""
        kernel = getattr(self._kernels, f"{format_name.lower()}_a8_linear")
        out_features = blocks.shape[0]

        def a8_kernel(x: torch.Tensor, packed: torch.Tensor) -> torch.Tensor:  # [T, K] -> [T, N]
            return kernel(x, packed, out_features)

        return GGUFBlockLinear(linear, PACKERS[format_name](blocks), a8_kernel,
                               f"{format_name}+a8", keep_weight=tied)
