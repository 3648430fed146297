"""The exact greedy token of several rows from an 8-bit screen of a Q8_0 GGUF head on AVX-512 VNNI
CPUs (no AMX), plus an exact recheck of the few columns that could win.

Why: without AMX the exact float32 head (csrc/gguf_linear.cpp) is bound by float32 FMAs from two
rows of x on: SmolLM2's 49152 x 576 head took 1.7 / 2.2 / 3.1 / 5.0 / 12.1 ms at 1 / 4 / 8 / 12 /
32 rows on the 2-core Ice Lake CI-class Xeon, a sixth of a verification pass. A greedy step needs
only each row's argmax. With x rounded to 8 bits per block of 32 (csrc/gguf_a8_linear.cpp, the
``gguf_a8`` kernel: 4x the multiply-adds per instruction) the same head took 1.6 / 1.6 / 1.7 /
2.4 / 5.2 ms. Those screened logits are not the exact ones, but their distance from them is
bounded per column, and a column whose upper bound lies below some column's lower bound can
never be the argmax; the few that can (one group of 16 columns for most rows of real text) are
computed again by the exact kernel, on just their weight rows, so they carry the very bits the
full head gives them.

Exactness: with A_n the screened logit, L_n the exact kernel's and x' the rounded row the screen
multiplies (x'_i = dx * round(x_i / dx) per block, dx = max |x| / 127),
    |A_n - L_n| <= |A_n - w_n.x'| + |w_n.(x' - x)| + |w_n.x - L_n|
               <= ||w_n|| * (||x - x'|| * (1 + SUM_SLACK) + SUM_SLACK * ||x||) + SLACK_ABS:
the middle term by Cauchy-Schwarz; the outer ones are float32 rounding of sums of exact
products (Q8_0 weights are d * q exactly, the 8-bit products are exact integers): at most
(K / 32 + 2) roundings of 2**-24 of sum_i |w_ni x'_i| <= ||w_n|| (||x|| + ||x - x'||) in the
screen and (K / 16 + 5) of sum_i |w_ni x_i| <= ||w_n|| ||x|| in the exact kernel, so 2**-12
(SUM_SLACK) covers both up to K = 2**15. The norms ||w_n|| are taken once at load (float64,
rounded up to float32), ||x - x'|| per row from the very rounding the kernel applies
(csrc/gguf_a8_linear.cpp: a8_screen_candidates), and SLACK_ABS covers products that underflow. A column with A_n + slack_n < max_m (A_m - slack_m) has L_n < L_m for that m, so it
is not the argmax; every column tied for the exact maximum passes. The argmax over the
rechecked columns (ascending) is then the full head's, the lowest index among equal maxima
included: greedy speculation stays token for token equal to plain decoding, and to transformers
wherever the exact head was. Per-column norms matter: with the largest norm for every column
(as the AMX screen takes it, greedy_screen.py) SmolLM2's rows kept a median of 9 and up to 988
groups; with each column's own, 1 and at most 19 (real hidden states of 3 code-edit answers).

Rows with a non-finite x or screened logit, and steps of fewer than MIN_ROWS rows, take the
exact head.
"""

from __future__ import annotations

from typing import ClassVar

import torch

from specserve.model.layers import fused_argmax
from specserve.model.layers.quantization.a8_packing import LANES, pack_q8_0
from specserve.model.layers.quantization.greedy_screen import MAX_IN_FEATURES, HeadScreen

SUM_SLACK = 2.0**-12  # both kernels' float32 sums, relative to ||w_n|| ||x|| (see above)
ROUNDING_ROOM = 1 + 2.0**-20  # the float64 norms' own rounding, and a little more
SLACK_ABS = 1e-25  # products that underflow: far below any logit gap
NORM_ROOM = 1 + 1e-6  # the float64 column norms' rounding


def column_norms(weight: torch.Tensor) -> torch.Tensor:
    """[N, K] float32 -> [N] float32 ||w_n||, never below the exact norm (float64 in slices of the
    head, so no float64 copy of it, then rounded up to float32)."""
    parts = []
    for rows in weight.detach().split(4096):
        exact = torch.linalg.vector_norm(rows.double(), dim=1) * NORM_ROOM  # [n]
        rounded = exact.float()
        parts.append(torch.where(rounded.double() < exact,
                                 torch.nextafter(rounded, torch.tensor(float("inf"))), rounded))
    return torch.cat(parts)


class VnniGreedyScreen(HeadScreen):
    """argmax rows of x @ W^T for a Q8_0 GGUF head: screened with 8-bit x, rechecked exactly."""

    # From 2 rows the screen and its recheck cost less than the exact head (SmolLM2 on the
    # 2-core Ice Lake: see BENCHMARKS.md "CPU, session 40").
    min_rows: ClassVar[int] = 2

    def __init__(self, kernels, weight: torch.Tensor) -> None:
        if weight.shape[1] > MAX_IN_FEATURES:
            raise ValueError(f"the greedy screen's bound holds for up to {MAX_IN_FEATURES} inputs")
        if weight.shape[0] % LANES:
            raise ValueError(f"the greedy screen needs whole groups of {LANES} columns")
        self._kernels = kernels
        self._n = weight.shape[0]
        self.column_norms = column_norms(weight)  # [N] float32, rounded up
        self._max_norm = float(self.column_norms.max())

    @staticmethod
    def pack(blocks: torch.Tensor) -> torch.Tensor:
        """The head's Q8_0 blocks [N, K / 32 * 34] as the 8-bit kernel reads them [N / 16,
        K / 32, 576] (kept by the layer, so that the loader may move them like its blocks)."""
        return pack_q8_0(blocks)

    def candidates(self, x: torch.Tensor, blocks: torch.Tensor, screen_blocks: torch.Tensor
                   ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The columns (whole groups of 16, ascending) holding every column that could be some
        row's argmax, and their rows of blocks; None when the bound does not apply (non-finite
        values)."""
        screened = self._kernels.q8_0_a8_linear(x, screen_blocks, self._n)  # [R, N]
        columns, rows, ok = self._kernels.a8_screen_candidates(
            screened, x, self.column_norms, self._max_norm, blocks, SUM_SLACK, ROUNDING_ROOM, SLACK_ABS)
        return (columns, rows) if ok else None  # [C], [C, K / 32 * 34]

    def argmax(self, x: torch.Tensor, blocks: torch.Tensor,
               screen_blocks: torch.Tensor | None = None) -> torch.Tensor:
        """x [R, K] float32 -> [R] int64: the exact head's argmax of every row. blocks: the
        head's Q8_0 rows [N, K / 32 * 34]; screen_blocks: pack(blocks)."""
        found = self.candidates(x, blocks, screen_blocks)
        if found is None:
            return fused_argmax.logits_argmax(self._kernels.q8_0_linear(x, blocks))
        columns, rows = found
        exact = self._kernels.q8_0_linear(x, rows)  # [R, C]: the full head's bits there
        return columns[fused_argmax.logits_argmax(exact)]
