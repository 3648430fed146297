"""The VNNI greedy screen of a Q8_0 GGUF head (quantization/greedy_screen_vnni.py) must give the
exact head's argmax of every row, ties to the lowest index included, on heads whose columns nearly
tie (where x rounded to 8 bits alone reorders them); with its bound switched off the same cases
must fail, so the test can see a wrong screen. Where the kernels did not build with AVX-512 VNNI
(their portable path is exact but slow, and the engine leaves the screen off there), the
screen is still exercised, since its bound does not depend on the instruction set."""

from __future__ import annotations

import pytest
import torch
from gguf import GGMLQuantizationType as QT
from gguf import dequantize, quantize
from helpers import NEAR_TIE_K as K
from helpers import gguf_blocks, near_tie_head

from specserve.model.layers import cpu_kernels, fused_argmax
from specserve.model.layers.quantization import greedy_screen_vnni
from specserve.model.layers.quantization.greedy_screen_vnni import VnniGreedyScreen, column_norms

kernels = cpu_kernels.load()
pytestmark = pytest.mark.skipif(kernels is None, reason="specserve's CPU kernels did not build")

def exact_argmax(x: torch.Tensor, raw: torch.Tensor) -> torch.Tensor:
    return fused_argmax.logits_argmax(kernels.q8_0_linear(x, raw))


def mismatches(seed: int) -> int:
    raw, dense = near_tie_head(seed)
    screen = VnniGreedyScreen(kernels, dense)
    packed = VnniGreedyScreen.pack(raw)
    gen = torch.Generator().manual_seed(seed)
    wrong = 0
    for rows in (2, 3, 4, 9):
        # x_i near 1: exact logits differ by ~2**-7 * d, while 8 bits per block (dx ~ 8 / 127
        # in the first block of row 0, 1 / 127 elsewhere) make most x_i equal, so the screen
        # alone reorders columns
        x = 1 + (torch.rand(rows, K, generator=gen) - 0.5) * 2**-6
        x[0, 0] = 8.0  # columns 5 and 40 tie exactly at the top of row 0
        x[1:, 0] = 0.0  # and take no part in the other rows' near ties
        got = screen.argmax(x, raw, packed)
        wrong += int((got != exact_argmax(x, raw)).sum())
        assert int(exact_argmax(x, raw)[0]) == 5 and int(got[0]) == 5
    return wrong


def test_screen_gives_the_exact_heads_argmax_on_near_ties():
    assert sum(mismatches(seed) for seed in range(40)) == 0


def test_screen_without_its_bound_would_fail(monkeypatch):
    monkeypatch.setattr(greedy_screen_vnni, "ROUNDING_ROOM", 0.0)  # slack 0: the screen alone
    monkeypatch.setattr(greedy_screen_vnni, "SLACK_ABS", 0.0)
    assert sum(mismatches(seed) for seed in range(40)) > 0


def test_screen_rechecks_few_columns_and_falls_back_on_non_finite_rows():
    raw, dense = gguf_blocks(QT.Q8_0, 256, K, seed=3)  # random weights: clear winners
    screen = VnniGreedyScreen(kernels, dense)
    packed = VnniGreedyScreen.pack(raw)
    x = torch.randn(4, K, generator=torch.Generator().manual_seed(0))
    full = exact_argmax(x, raw)
    columns, rows = screen.candidates(x, raw, packed)
    assert columns.numel() <= 8 * 16 and columns.numel() % 16 == 0  # of 256: ~one group a row
    assert set(full.tolist()) <= set(columns.tolist())
    assert torch.equal(rows, raw.index_select(0, columns))  # the recheck's weight rows
    assert torch.equal(screen.argmax(x, raw, packed), full)
    x[1, 3] = float("inf")
    assert screen.candidates(x, raw, packed) is None  # no bound: the exact head decides
    assert torch.equal(screen.argmax(x, raw, packed), exact_argmax(x, raw))


def test_column_norms_never_fall_below_the_exact_norms():
    weight = torch.randn(300, 64, generator=torch.Generator().manual_seed(1))
    norms = column_norms(weight)
    assert norms.dtype == torch.float32 and norms.shape == (300,)
    assert bool((norms.double() >= torch.linalg.vector_norm(weight.double(), dim=1)).all())


def test_screen_refuses_heads_it_cannot_bound():
    with pytest.raises(ValueError, match="groups of 16"):
        VnniGreedyScreen(kernels, torch.randn(250, K))


def scan_groups(scores: torch.Tensor, x: torch.Tensor, norms: torch.Tensor,
                widen: float) -> set[int]:
    """The candidate groups of a plain scan of every column, in float64 (x' as the kernel rounds
    it), the slack scaled by widen: what a8_screen_candidates must return for widen ~1."""
    rows, k = x.shape
    blocks = x.double().view(rows, k // 32, 32)
    dx = (blocks.abs().amax(-1, keepdim=True).float() / 127).double()  # the kernel's float d
    codes = torch.where(dx > 0, torch.round(blocks.float() * (1 / dx.float())).double(), 0.0)
    error = (blocks - dx * codes.clamp(-127, 127)).view(rows, k).norm(dim=1)  # [R]
    e = (error * (1 + greedy_screen_vnni.SUM_SLACK)
         + greedy_screen_vnni.SUM_SLACK * x.double().norm(dim=1)) * widen
    slack = norms.double()[None] * e[:, None]  # [R, N]
    lower = (scores.double() - slack).max(dim=1, keepdim=True).values
    live = (scores.double() + slack) >= lower  # [R, N]
    return set(torch.nonzero(live.view(rows, -1, 16).any(-1).any(0)).view(-1).tolist())


def test_candidates_equal_a_scan_of_every_column_with_uneven_column_norms():
    """The kernel looks at the columns near each row's top score only (a prefilter by the
    largest norm) and finds the largest lower bound among them: with column norms 100x apart,
    where the column with the top score is often not the one with the best lower bound, it
    must keep exactly what a scan of every column keeps (up to float rounding at the edge)."""
    _, dense = gguf_blocks(QT.Q8_0, 512, K, seed=5)
    order = torch.randperm(512, generator=torch.Generator().manual_seed(2))
    scaled = dense * torch.logspace(-1, 1, 512)[order][:, None]  # norms 100x apart
    raw = torch.from_numpy(quantize(scaled.numpy(), QT.Q8_0))
    dense = torch.from_numpy(dequantize(raw.numpy(), QT.Q8_0).astype("float32"))
    screen = VnniGreedyScreen(kernels, dense)
    packed = VnniGreedyScreen.pack(raw)
    gen = torch.Generator().manual_seed(7)
    for rows in (1, 2, 5, 9):
        for _ in range(10):
            x = torch.randn(rows, K, generator=gen) * 3
            scores = kernels.q8_0_a8_linear(x, packed, 512)
            columns, _ = screen.candidates(x, raw, packed)
            got = set((columns[::16] // 16).tolist())
            assert scan_groups(scores, x, screen.column_norms, 1 - 1e-5) <= got
            assert got <= scan_groups(scores, x, screen.column_norms, 1 + 1e-5)
            assert torch.equal(screen.argmax(x, raw, packed), exact_argmax(x, raw))
