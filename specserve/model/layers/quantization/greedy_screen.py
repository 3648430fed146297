"""The exact greedy token of several rows from a cheap bfloat16 screen of the GGUF head plus an
exact recheck of the few columns that could win (AMX CPUs).

Why: a greedy verification step needs only the argmax of each row's logits, but the exact
float32 head (quantization/gguf_amx.py, x as 3 bfloat16 parts) fits only 5 rows of x in a tile
job, so a 9-row verification multiplies SmolLM2's 49152 x 576 head twice per block. With x
rounded to one bfloat16 part a job holds 16 rows: one multiply per block. The screen's logits
are not the exact ones, but their distance from them is bounded, and any column whose screened
logit cannot reach the best lower bound can never be the argmax; the rest (a handful) are
computed again exactly, by the same kernel on just their groups of 16 columns, so they carry the
very bits the full head gives them.

Exactness: with A_n the screened logit and L_n the exact kernel's logit of column n for a row x,
and x' = x rounded to bfloat16 (what the screen multiplies: round to nearest even, as torch's
conversion), both kernels sum exact products in float32, each within ~(K / 32 + 64) roundings
of 2**-24 of sum_i |w_ni x_i| (and a little more for x'), so by Cauchy-Schwarz
    |A_n - L_n| <= max_n ||w_n|| * (||x - x'|| + SUM_SLACK * ||x||) + SLACK_ABS = slack,
with max_n ||w_n|| taken once at load (float64, rounded up), ||x - x'|| and ||x|| per row in
float64, SUM_SLACK covering both kernels' float32 sums with room, and SLACK_ABS the denormal
products the tile unit flushes to zero. A column with A_n + slack < max_m (A_m - slack) has
L_n < L_m for that m, so it is not the argmax; every column tied for the exact maximum passes
the screen. The argmax over the rechecked groups (in ascending column order) is then the full
head's argmax, the lowest index among equal maxima included: the tokens are those of the exact
head, so greedy speculation stays token for token equal to plain decoding, and to transformers
wherever the exact head was.

Rows with a non-finite norm or screened maximum, a head with a bias, or too few rows take the
exact head and the C++ argmax as before.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import ClassVar

import torch

from specserve.model.layers import fused_argmax
from specserve.model.layers.quantization.gguf_amx import LANES

SUM_SLACK = 2.0**-12  # both kernels' float32 sums, relative to ||w_n|| ||x|| (see above)
MAX_IN_FEATURES = 2**15  # SUM_SLACK holds up to here: 2 x (K / 32 + 64) x 2**-24 < 2**-12
ROUNDING_ROOM = 1 + 2.0**-20  # the float64 norms' own rounding, and a little more
# what flushing denormals can move a logit by: K x 3 parts x FLT_MIN (1.2e-38) x d (at most
# f16's 65504) stays under 1e-29 for K up to MAX_IN_FEATURES; this is far below any logit gap
SLACK_ABS = 1e-25
# Rows from which the screen pays: up to 5 rows the exact head is one tile job per block too,
# and the screen's extra passes (its candidates, the recheck) cost ~0.05-0.1 ms more than they
# save; at 6 / 9 / 16 / 32 rows SmolLM2's head took 1.93 / 2.28 / 4.0 / 7.4 ms exact and 1.79 /
# 2.07 / 2.35 / 4.15 ms screened (BENCHMARKS.md "CPU, session 34").
MIN_ROWS = 6


class HeadScreen(ABC):
    """A GGUF head's cheaper way to the exact argmax of several rows (GGUFBlockLinear.
    greedy_tokens): screen every column, recheck exactly the few that could win."""

    min_rows: ClassVar[int]  # steps of fewer rows take the exact head's logits

    @abstractmethod
    def argmax(self, x: torch.Tensor, blocks: torch.Tensor,
               screen_blocks: torch.Tensor | None = None) -> torch.Tensor:
        """x [R, K] float32 -> [R] int64, the exact head's argmax of every row. blocks: the
        head's own weights as its layer keeps them; screen_blocks: a second copy of them laid
        out for the screen's kernel, where it needs one."""


class GreedyScreen(HeadScreen):
    """argmax rows of x @ W^T for a GGUF head on AMX tiles: screened in 1 part, rechecked in 3."""

    min_rows: ClassVar[int] = MIN_ROWS

    def __init__(self, amx_fn, out_features: int, weight: torch.Tensor,
                 screen_groups) -> None:
        if weight.shape[1] > MAX_IN_FEATURES:
            raise ValueError(f"the greedy screen's bound holds for up to {MAX_IN_FEATURES} inputs")
        self._fn = amx_fn  # (x [R, K], packed [G, blocks, bytes], n, parts) -> [R, n]
        self._screen_groups = screen_groups  # csrc/argmax.cpp
        self._n = out_features
        self._max_row_norm = max(  # float64 (in slices: no float64 copy of the head), rounded up
            float(torch.linalg.vector_norm(rows.double(), dim=1).max())
            for rows in weight.detach().split(4096)) * (1 + 1e-6)

    def candidates(self, x: torch.Tensor, packed: torch.Tensor) -> torch.Tensor | None:
        """Groups (ascending) holding every column that could be some row's argmax; None when
        the bound does not apply (non-finite values). packed: the head's records [N / 16,
        K / 32, bytes] (passed in, not kept: the loader may move them, model/huge_pages.py)."""
        screened = self._fn(x, packed, self._n, 1)  # [R, N]
        # slack per row, in float64: max ||w_n|| * (||x - x'|| + SUM_SLACK ||x||) * ROUNDING_ROOM
        # + SLACK_ABS; then every group with a column >= the row's max - 2 slack
        groups, ok = self._screen_groups(screened, x, self._max_row_norm, SUM_SLACK,
                                         ROUNDING_ROOM, SLACK_ABS)  # [G'] sorted
        return groups if ok else None

    def argmax(self, x: torch.Tensor, packed: torch.Tensor,
               screen_blocks: torch.Tensor | None = None) -> torch.Tensor:
        """x [R, K] float32 -> [R] int64: the exact head's argmax of every row (the screen
        reads the head's own AMX records: no screen_blocks)."""
        groups = self.candidates(x, packed)
        if groups is None:
            return fused_argmax.logits_argmax(self._fn(x, packed, self._n, 3))
        exact = self._fn(x, packed.index_select(0, groups), LANES * groups.numel(), 3)
        best = fused_argmax.logits_argmax(exact)  # [R] column within the rechecked groups
        return groups[best // LANES] * LANES + best % LANES
