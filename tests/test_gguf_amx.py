"""GGUF block products on AMX tiles (csrc/gguf_amx_linear.cpp, quantization/gguf_amx.py).

The kernel must give the float32 model's products: a float64 product of the dequantized weights
to float32 rounding, with x taken exactly (its three bfloat16 parts sum to it; a one-part split
would fail test_amx_linear_takes_x_exactly); an output's bits must depend only on its own row
(verification of k + 1 rows equals k + 1 decode steps); and the packers must put every code and
scale where the kernel reads it. The packers are checked on every machine; the kernel where the
CPU has AMX (Intel Xeon from Sapphire Rapids on), and skipped, saying so, elsewhere.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as QT
from helpers import gguf_blocks

from specserve.model.layers import cpu_kernels
from specserve.model.layers.quantization import gguf_amx

kernels = cpu_kernels.load()
HAS_AMX = kernels is not None and bool(kernels.amx_ready())
needs_amx = pytest.mark.skipif(not HAS_AMX, reason="this CPU (or its build) has no AMX tiles")

# 3 parts: 1-5 rows per tile job, 1-7 jobs; 2 parts: up to 8 rows per job; 1 part: up to 16
ROW_COUNTS = [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 16, 17, 25, 33]
FORMATS = [(QT.Q4_1, "Q4_1"), (QT.Q8_0, "Q8_0")]
PARTS = [3, 2, 1]  # bfloat16 parts of x: torch's float32 matmul precision highest / high / medium


def split_sum(x: torch.Tensor, parts: int) -> torch.Tensor:
    """What the kernel takes x as: the sum of `parts` bfloat16 parts, each the remainder of the
    ones before rounded to nearest (float64; 3 parts give x exactly)."""
    rest, total = x.clone(), torch.zeros_like(x, dtype=torch.float64)
    for _ in range(parts):
        part = rest.to(torch.bfloat16).float()
        total += part.double()
        rest = rest - part  # exact
    return total


def _tile_codes(packed: torch.Tensor, fmt: str) -> torch.Tensor:
    """What the kernel's unpack puts in the B tile: [G, B, 16 tile rows, 32 words] codes."""
    if fmt == "Q4_1":
        words = packed[..., :256].contiguous().view(torch.int16).to(torch.int32) & 0xFFFF
        words = words.view(*packed.shape[:2], 4, 32)  # [G, B, chunk, word]
        rows = [(words >> (4 * i)) & 15 for i in range(4)]  # tile row 4c + i
        return torch.stack(rows, dim=3).view(*packed.shape[:2], 16, 32)
    return packed[..., :512].contiguous().view(torch.int8).view(*packed.shape[:2], 16, 32)


@pytest.mark.parametrize("qtype,fmt", FORMATS)
def test_packers_put_every_code_and_scale_where_the_kernel_reads_it(qtype, fmt):
    """Read back as the kernel does (tile row kp, word 2n + j = code of input 2kp + j of weight
    row n), the records must give the dequantized weights exactly."""
    raw, dense = gguf_blocks(qtype, 32, 96, seed=7)
    packed = gguf_amx.PACKERS[fmt](raw)  # [G, B, record]
    g, b = packed.shape[:2]
    assert (g, b) == (2, 3) and packed.dtype == torch.uint8
    codes = _tile_codes(packed, fmt).to(torch.float32)  # [G, B, kp, 2n + j]
    codes = codes.view(g, b, 16, 16, 2).permute(0, 3, 1, 2, 4).reshape(g * 16, b, 32)  # [N, B, k]
    scales = 256 if fmt == "Q4_1" else 512
    d = packed[..., scales:scales + 32].contiguous().view(torch.float16).float()  # [G, B, 16]
    d = d.permute(0, 2, 1).reshape(g * 16, b, 1)
    w = codes * d
    if fmt == "Q4_1":
        m = packed[..., 288:320].contiguous().view(torch.float16).float()
        w = w + m.permute(0, 2, 1).reshape(g * 16, b, 1)
    assert torch.equal(w.view(g * 16, -1), dense)


def test_packers_need_whole_groups_of_16_rows():
    raw, _ = gguf_blocks(QT.Q4_1, 24, 64, seed=0)
    with pytest.raises(ValueError, match="multiple of 16"):
        gguf_amx.pack_q4_1(raw)


def block_mins(raw: torch.Tensor, fmt: str) -> torch.Tensor:
    """[N, K] float64: each weight's block minimum m (Q4_1's second float16; Q8_0 has none)."""
    if fmt != "Q4_1":
        return torch.zeros(raw.shape[0], raw.shape[1] // 34 * 32, dtype=torch.float64)
    blocks = raw.view(raw.shape[0], -1, 20)  # [N, B, 20]
    m = blocks[..., 2:4].contiguous().view(torch.float16).double()  # [N, B, 1]
    return m.expand(-1, -1, 32).reshape(raw.shape[0], -1)


def reference(x: torch.Tensor, raw: torch.Tensor, dense: torch.Tensor, fmt: str,
              parts: int) -> torch.Tensor:
    """float64 [M, N]: the codes' terms d * q times x's parts' sum, the block minimum's terms
    m times x itself (the kernel applies m to the block's exact float32 sum of x)."""
    mins = block_mins(raw, fmt)
    return split_sum(x, parts) @ (dense.double() - mins).t() + x.double() @ mins.t()


def within_rounding(got: torch.Tensor, ref: torch.Tensor, x: torch.Tensor,
                    dense: torch.Tensor) -> bool:
    """Whether got is ref to float32 rounding: bounded by |x| @ |w| (the sums' magnitude)."""
    scale = x.abs().double() @ dense.abs().double().t()
    return bool(((got.double() - ref).abs() <= 1e-6 * scale + 1e-7).all())


def amx(fmt: str, x: torch.Tensor, raw: torch.Tensor, parts: int = 3) -> torch.Tensor:
    return getattr(kernels, f"{fmt.lower()}_amx_linear")(x, gguf_amx.PACKERS[fmt](raw),
                                                          raw.shape[0], parts)


@needs_amx
@pytest.mark.parametrize("parts", PARTS)
@pytest.mark.parametrize("qtype,fmt", FORMATS)
@pytest.mark.parametrize("out_features", [16, 48])  # one group, several (threads split them)
def test_amx_linear_equals_dequantized_matmul(qtype, fmt, out_features, parts):
    """3 parts: the float32 model's products (x exactly); fewer: the codes' terms those of x's
    parts' sum."""
    raw, dense = gguf_blocks(qtype, out_features, 96, seed=out_features)
    gen = torch.Generator().manual_seed(1)
    for rows in [0, *ROW_COUNTS]:
        x = torch.randn(rows, 96, generator=gen)
        got = amx(fmt, x, raw, parts)  # [rows, N]
        assert got.shape == (rows, out_features) and got.dtype == torch.float32
        assert within_rounding(got, reference(x, raw, dense, fmt, parts), x, dense), rows


@needs_amx
@pytest.mark.parametrize("parts", PARTS)
def test_amx_linear_takes_x_as_its_parts(parts):
    """Weights that pick one input each (Q8_0, d = 1, one code 1 per row): y must be x's parts'
    sum bit for bit. With 3 parts that is x itself, which needs all 24 bits of each x (one
    bfloat16 part keeps 8, two keep ~16); with fewer it must differ from x (the power check of
    the parts argument)."""
    n, k = 32, 64
    blocks = np.zeros((n, k // 32, 34), dtype=np.uint8)
    blocks[:, :, 0:2] = np.frombuffer(np.float16(1.0).tobytes(), dtype=np.uint8)
    pick = torch.randperm(k, generator=torch.Generator().manual_seed(3))[:n]
    for row, col in enumerate(pick.tolist()):
        blocks[row, col // 32, 2 + col % 32] = 1
    raw = torch.from_numpy(blocks.reshape(n, -1))
    x = torch.randn(7, k, generator=torch.Generator().manual_seed(4)) * torch.logspace(-3, 3, k)
    got = amx("Q8_0", x, raw, parts)
    assert torch.equal(got, split_sum(x, parts).float()[:, pick])
    assert torch.equal(got, x[:, pick]) == (parts == 3)


@needs_amx
@pytest.mark.parametrize("parts", PARTS)
@pytest.mark.parametrize("qtype,fmt", FORMATS)
def test_amx_linear_bits_depend_only_on_the_row(qtype, fmt, parts):
    """Each row alone gives the same bits as inside any batch: the tile jobs' row groups change
    with the row count (3 parts, 6 rows: 2 jobs of 3), never an output's summation order."""
    raw, _ = gguf_blocks(qtype, 48, 128, seed=5)
    x = torch.randn(33, 128, generator=torch.Generator().manual_seed(6))
    alone = torch.cat([amx(fmt, x[i:i + 1], raw, parts) for i in range(33)])
    for rows in ROW_COUNTS:
        assert torch.equal(amx(fmt, x[:rows], raw, parts), alone[:rows]), rows
    assert torch.equal(amx(fmt, x[5:11], raw, parts), alone[5:11])


@needs_amx
def test_amx_linear_wrong_code_would_fail():
    """Power check: the tolerance above sees a one-code error in one block."""
    raw, dense = gguf_blocks(QT.Q4_1, 16, 64, seed=3)
    broken = raw.clone()
    broken[5, 4 + 3] ^= 1  # one 4-bit code of row 5, block 0
    x = torch.randn(1, 64, generator=torch.Generator().manual_seed(2))
    assert not within_rounding(amx("Q4_1", x, broken), reference(x, raw, dense, "Q4_1", 3), x,
                               dense)


@needs_amx
def test_amx_linear_rejects_bad_shapes():
    raw, _ = gguf_blocks(QT.Q4_1, 16, 64, seed=0)
    packed = gguf_amx.pack_q4_1(raw)
    with pytest.raises(RuntimeError, match="do not match"):
        kernels.q4_1_amx_linear(torch.randn(2, 96), packed, 16)
    with pytest.raises(RuntimeError, match="groups"):
        kernels.q4_1_amx_linear(torch.randn(2, 64), packed, 32)
    with pytest.raises(RuntimeError, match="float32"):
        kernels.q4_1_amx_linear(torch.randn(2, 64, dtype=torch.float64), packed, 16)
    with pytest.raises(RuntimeError, match="parts must be 1, 2 or 3"):
        kernels.q4_1_amx_linear(torch.randn(2, 64), packed, 16, 4)


def test_amx_switch(monkeypatch):
    """SPECSERVE_AMX=0 keeps the AVX-512 kernel; otherwise AMX is used exactly where it runs."""
    monkeypatch.setenv(gguf_amx.DISABLE_ENV, "0")
    assert not gguf_amx.wanted(kernels)
    monkeypatch.delenv(gguf_amx.DISABLE_ENV)
    assert gguf_amx.wanted(kernels) == HAS_AMX
    assert not gguf_amx.wanted(None)


def test_parts_follow_torchs_float32_matmul_precision():
    """The layers read torch's setting at load: highest (its default) 3 parts, high 2, medium 1."""
    before = torch.get_float32_matmul_precision()
    try:
        for precision, parts in [("highest", 3), ("high", 2), ("medium", 1)]:
            torch.set_float32_matmul_precision(precision)
            assert gguf_amx.parts_for_precision() == parts
    finally:
        torch.set_float32_matmul_precision(before)
    with pytest.raises(ValueError, match="not one of"):
        gguf_amx.parts_for_precision("low")
