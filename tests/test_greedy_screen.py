"""The greedy screen of an AMX GGUF head (quantization/greedy_screen.py) must give the exact
head's argmax of every row, ties to the lowest index included, on heads whose columns nearly tie
(where the bfloat16 screen alone reorders them); with its bound switched off the same cases must
fail, so the test can see a wrong screen. Where the CPU has no AMX tiles the kernels are not
there, and these are skipped, saying so."""

from __future__ import annotations

import pytest
import torch
from gguf import GGMLQuantizationType as QT
from helpers import NEAR_TIE_K as K
from helpers import NEAR_TIE_N as N
from helpers import gguf_blocks, near_tie_head

from specserve.model.layers import cpu_kernels, fused_argmax
from specserve.model.layers.quantization import gguf_amx, greedy_screen
from specserve.model.layers.quantization.greedy_screen import GreedyScreen

kernels = cpu_kernels.load()
HAS_AMX = kernels is not None and bool(kernels.amx_ready())
pytestmark = pytest.mark.skipif(not HAS_AMX, reason="this CPU (or its build) has no AMX tiles")


def exact_argmax(x: torch.Tensor, packed: torch.Tensor) -> torch.Tensor:
    return fused_argmax.logits_argmax(kernels.q8_0_amx_linear(x, packed, N, 3))


def mismatches(seed: int) -> int:
    raw, dense = near_tie_head(seed)
    packed = gguf_amx.PACKERS["Q8_0"](raw)
    screen = GreedyScreen(kernels.q8_0_amx_linear, N, dense, kernels.screen_groups)
    gen = torch.Generator().manual_seed(seed)
    wrong = 0
    for rows in (2, 3, 4, 9):  # few rows: the groups rechecked for them are few
        # x_i near 1 (bfloat16 spacing there: 2**-7): exact logits differ by ~2**-9 * d, the
        # screen's by 0 or 2**-7 * d, so it reorders columns
        x = 1 + (torch.rand(rows, K, generator=gen) - 0.5) * 2**-6
        x[0, 0] = 8.0  # columns 5 and 40 tie exactly at the top of row 0
        x[1:, 0] = 0.0  # and take no part in the other rows' near ties
        wrong += int((screen.argmax(x, packed) != exact_argmax(x, packed)).sum())
        assert int(exact_argmax(x, packed)[0]) == 5
    return wrong


def test_screen_gives_the_exact_heads_argmax_on_near_ties():
    assert sum(mismatches(seed) for seed in range(40)) == 0


def test_screen_without_its_bound_would_fail(monkeypatch):
    monkeypatch.setattr(greedy_screen, "ROUNDING_ROOM", 0.0)  # slack 0: the screen alone
    monkeypatch.setattr(greedy_screen, "SLACK_ABS", 0.0)
    assert sum(mismatches(seed) for seed in range(40)) > 0


def test_screen_rechecks_few_groups_and_falls_back_on_non_finite_rows():
    raw, dense = gguf_blocks(QT.Q8_0, 256, K, seed=3)  # random weights: clear winners
    packed = gguf_amx.PACKERS["Q8_0"](raw)
    screen = GreedyScreen(kernels.q8_0_amx_linear, 256, dense, kernels.screen_groups)
    x = torch.randn(4, K, generator=torch.Generator().manual_seed(0))
    full = fused_argmax.logits_argmax(kernels.q8_0_amx_linear(x, packed, 256, 3))
    groups = screen.candidates(x, packed)
    assert groups is not None and groups.numel() <= 8  # of 16: about one per row
    assert set((full // gguf_amx.LANES).tolist()) <= set(groups.tolist())
    assert torch.equal(screen.argmax(x, packed), full)
    x[1, 3] = float("inf")
    assert screen.candidates(x, packed) is None  # no bound: the exact head decides
    assert torch.equal(screen.argmax(x, packed),
                       fused_argmax.logits_argmax(kernels.q8_0_amx_linear(x, packed, 256, 3)))
