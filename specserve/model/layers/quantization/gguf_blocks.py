"""GGUF checkpoints keep their Q4_1 / Q8_0 blocks: float32 arithmetic at 4-8 bits per weight read.

Why: batch-1 decoding on a CPU is bound by the bytes of weights it reads. SmolLM2's GGUF stores
its matrices as Q4_1 (and the tied embedding as Q8_0): 98 MB. Dequantized to float32 at load
they become 540 MB, and every decode step streams all of it. The kernel here (csrc/gguf_linear.cpp,
see layers/cpu_kernels.py) reads the file's raw blocks and decodes each one in
registers into exactly the float32 values the dequantizer gives (d * q + m, one rounding), then
multiplies in float32. So this is *not* an approximation like ``quantization="int4"``: the model
is the same float32 model as the dequantized one, and results differ from a dense matmul only in
summation order, as any two GEMM kernels do (tests/test_loader.py checks every projection of a
synthetic GGUF against its dequantized weight, tests/test_smollm2.py greedy output against
transformers).

AMX: on a CPU with AMX tiles (Intel Xeon from Sapphire Rapids on) the blocks are repacked once
at load for csrc/gguf_amx_linear.cpp (gguf_amx.py), which gives the same float32 model's
products with x split exactly into bfloat16 parts: on a 2-core Xeon 1.04-1.16x the AVX-512
kernel at 1-4 rows, 0.95-0.99x at 6, 1.3-1.8x at 9-32 (batch-32 decoding, long verifications,
prompts). ``SPECSERVE_AMX=0`` keeps the AVX-512 kernel. The choice is made once per layer, never
per row count, so a row's bits never depend on its batch. There alone, torch's float32 matmul
precision "high" / "medium" (read at load) trades the exact split for speed: 2 / 1 bfloat16 parts
of x, 8 / 16 rows per tile job (gguf_amx.py).

Greedy heads: a Q8_0 head gets a greedy screen for steps of several rows, which finds each row's
exact argmax from cheaper logits plus an exact recheck of the few columns that could win: on AMX
tiles (greedy_screen.py) and, without AMX, on AVX-512 VNNI with 8-bit inputs
(greedy_screen_vnni.py). The tokens are the exact head's either way.

When: a GGUF model on the CPU in float32 uses it by default, as vLLM uses its GGUF kernels for
GGUF files (``quantization="gguf"`` asks for it explicitly; ``SPECSERVE_CPU_KERNELS=0`` turns
the default off, see layers/cpu_kernels.py). Matrices of other GGUF types (Q4_K, Q6_K, ...)
stay dense float32.

Rows: every float32 product goes through the kernel, whatever its row count. Its tiles decode
each block once for up to 11 rows of x and keep a panel of weight rows in cache while every tile
of x passes, so at many rows it is bound by float32 FMAs (AVX-512 here), while MKL's sgemm on the
dense weight runs at its AVX2 rate on this AMD CPU and reads 6.4x the bytes. Measured on the
2-core CI machine (2026-12-04, session 13, one shape each, weights cold): SmolLM2's gate 1536x576
at 32 / 128 / 512 rows 0.27 / 0.94 / 3.8 ms against dense 0.55 / 1.40 / 4.9 ms; the Q8_0 head
at 32 rows 8.6 against 32.8 ms. In the engine, batch-32 decoding ran 2.2x (chat) and 1.7x
(code edits) the tokens per second, and prefill 1.6x (902-971 against 546-605 prompt tokens
per second), with the same greedy tokens. (Until then rows above 16 went to the dense weight:
the kernel of session 2, before its AVX-512 decode, measured 107 against 77 ms at 32 rows.)
So the layers keep no dense copy: their ``weight`` is None, except a head tied to the embedding,
whose weight is the embedding table (the lookup needs it anyway). SmolLM2's float32 copies were
424 MB of the model's 540 MB of tensors.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import ClassVar

import torch
from torch import nn

from specserve.model.layers import cpu_kernels, fused_argmax
from specserve.model.layers.quantization import gguf_amx, greedy_screen_vnni
from specserve.model.layers.quantization.base import LM_HEAD_ROLE, QuantizationMethod
from specserve.model.layers.quantization.greedy_screen import GreedyScreen, HeadScreen
from specserve.model.layers.quantization.greedy_screen_vnni import VnniGreedyScreen

BlockKernel = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]  # x [M, K], blocks -> [M, N]


class GGUFBlockLinear(nn.Module):
    """``nn.Linear`` whose products read the GGUF blocks (a float32 model: float32 inputs).

    ``bias`` stays the dense layer's; ``weight`` is None unless keep_weight (a head tied to the
    embedding: then it is the embedding table, shared, not copied)."""

    def __init__(self, linear: nn.Linear, blocks: torch.Tensor, kernel: BlockKernel,
                 format_name: str, keep_weight: bool = False) -> None:
        super().__init__()
        self.weight = linear.weight if keep_weight else None  # [N, K] float32 or None
        self.bias = linear.bias
        self.register_buffer("blocks", blocks)  # [N, K / 32 * block bytes] uint8, GGUF's bytes
        self._kernel = kernel
        # a head's greedy screen (greedy_screen.py on AMX, greedy_screen_vnni.py on VNNI), and
        # the copy of its weights that screen reads, if it reads its own (a buffer, so that the
        # loader moves it with the rest: model/huge_pages.py)
        self.greedy_screen: HeadScreen | None = None
        self.register_buffer("screen_blocks", None, persistent=False)
        self.format_name = format_name
        self.in_features, self.out_features = linear.in_features, linear.out_features

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [..., K] -> [..., N]
        y = self._kernel(x.reshape(-1, self.in_features), self.blocks)  # [T, N]
        if self.bias is not None:
            y = y + self.bias
        return y.view(*x.shape[:-1], self.out_features)

    def greedy_tokens(self, x: torch.Tensor) -> torch.Tensor:
        """x [R, K] -> [R] int64, the argmax of each row of forward(x): through the greedy
        screen where this head has one and there are enough rows, else the logits."""
        screen = self.greedy_screen
        if screen is not None and x.dim() == 2 and x.shape[0] >= screen.min_rows:
            return screen.argmax(x, self.blocks, self.screen_blocks)
        return fused_argmax.logits_argmax(self(x))

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"blocks={self.format_name}")


class GGUFBlocks(QuantizationMethod):
    name: ClassVar[str] = "gguf"
    description: ClassVar[str] = ("keep a GGUF file's Q4_1 / Q8_0 blocks and multiply in float32 "
                                  "(same results as the dequantized weights); CPU, float32")
    devices: ClassVar[frozenset[str]] = frozenset({"cpu"})

    def __init__(self) -> None:
        self._blocks: dict[str, tuple[torch.Tensor, str]] = {}
        self._kernels = None
        self._amx = False  # products on AMX tiles (gguf_amx.py) where the CPU has them
        self._amx_parts = 3  # bfloat16 parts of x there (torch's float32 matmul precision)
        self._embedding_tables: set[int] = set()  # data_ptr of every embedding weight

    def bind(self, model: nn.Module, source) -> None:
        if not getattr(source, "is_gguf", False):
            raise ValueError(f"quantization={self.name!r} needs a .gguf model; {source.name} is "
                             "not one.")
        self._kernels = cpu_kernels.load()
        if self._kernels is None:
            return
        from specserve.model.gguf_loader import linear_blocks

        self._blocks = linear_blocks(source.gguf_file, model)
        self._amx = gguf_amx.wanted(self._kernels)
        self._amx_parts = gguf_amx.parts_for_precision()  # read once: every layer alike
        self._embedding_tables = {m.weight.data_ptr() for m in model.modules()
                                  if isinstance(m, nn.Embedding)}

    def quantize_linear(self, linear: nn.Linear, role: str, name: str) -> nn.Module | None:
        found = self._blocks.get(name)
        if found is None or linear.weight.dtype != torch.float32:
            return None
        blocks, format_name = found
        tied = linear.weight.data_ptr() in self._embedding_tables
        return self._block_linear(linear, blocks, format_name, tied, role)

    def _block_linear(self, linear: nn.Linear, blocks: torch.Tensor, format_name: str,
                      tied: bool, role: str) -> GGUFBlockLinear:
        """The layer over the file's blocks [N, K / 32 * block bytes] of type format_name: on AMX
        tiles where the CPU has them (repacked, see gguf_amx.py), else the AVX-512 kernel. The
        choice is made per layer once, so every row count of a layer takes the same path (an
        AMX head's greedy screen computes no logit of its own: its tokens are the exact
        head's, see greedy_screen.py)."""
        if self._amx and blocks.shape[0] % gguf_amx.LANES == 0:
            kernel = gguf_amx.kernel(self._kernels, format_name, out_features=blocks.shape[0],
                                     parts=self._amx_parts)
            layer = GGUFBlockLinear(linear, gguf_amx.PACKERS[format_name](blocks), kernel,
                                    format_name + gguf_amx.FORMAT_SUFFIX[self._amx_parts],
                                    keep_weight=tied)
            if (role == LM_HEAD_ROLE and format_name == "Q8_0" and self._amx_parts == 3
                    and linear.bias is None):
                # greedy steps of several rows: screened in 1 bfloat16 part, rechecked exactly
                # (Q8_0: the weights are d * q, the vector greedy_screen.py's bound needs)
                layer.greedy_screen = GreedyScreen(self._kernels.q8_0_amx_linear,
                                                   layer.out_features, linear.weight,
                                                   self._kernels.screen_groups)
            return layer
        kernel = getattr(self._kernels, f"{format_name.lower()}_linear")
        layer = GGUFBlockLinear(linear, blocks, kernel, format_name, keep_weight=tied)
        if (role == LM_HEAD_ROLE and format_name == "Q8_0" and linear.bias is None
                and self._kernels.a8_vnni() and layer.out_features % gguf_amx.LANES == 0
                and layer.in_features <= greedy_screen_vnni.MAX_IN_FEATURES):
            # greedy steps of several rows: screened with 8-bit x, rechecked exactly
            # (Q8_0: the weights are d * q, the vector greedy_screen_vnni.py's bound needs)
            layer.greedy_screen = VnniGreedyScreen(self._kernels, linear.weight)
            layer.screen_blocks = VnniGreedyScreen.pack(blocks)
        return layer
