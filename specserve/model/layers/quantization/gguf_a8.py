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

Layout: the blocks are repacked once at load (a8_packing.py).
"""

from __future__ import annotations

import logging
from typing import ClassVar

import torch
from torch import nn

from specserve.model.layers.quantization.a8_packing import PACKERS
from specserve.model.layers.quantization.gguf_blocks import GGUFBlockLinear, GGUFBlocks

logger = logging.getLogger(__name__)


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
