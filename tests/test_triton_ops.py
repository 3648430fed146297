"""Fused RMSNorm and rotary kernels (layers/triton_ops.py) against the torch reference, on CPU
under the Triton interpreter (see test_triton_attention.py for why the variable is set here)."""

from __future__ import annotations

import os
import sys

import pytest
import torch

if "triton" not in sys.modules:
    os.environ["TRITON_INTERPRET"] = "1"
pytest.importorskip("triton")
pytestmark = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1",
                                reason="triton was imported before the interpreter was chosen")

from specserve.model.layers import gemv, triton_ops  # noqa: E402
from specserve.model.layers.norm import RMSNorm  # noqa: E402
from specserve.model.layers.rotary import RotaryEmbedding  # noqa: E402


def _random_norm(hidden: int, eps: float, gen: torch.Generator) -> RMSNorm:
    """An RMSNorm with weights away from 1, so a kernel that ignored them would fail."""
    norm = RMSNorm(hidden, eps)
    with torch.no_grad():
        norm.weight.copy_(torch.rand(hidden, generator=gen) + 0.5)
    return norm


@pytest.mark.parametrize("hidden", [64, 96])
def test_rms_norm_matches_module(hidden):
    gen = torch.Generator().manual_seed(0)
    norm = _random_norm(hidden, 1e-5, gen)
    x = torch.randn(5, 2 * hidden, generator=gen)[:, :hidden] * 3  # a strided view
    ref = norm(x)  # CPU: the torch path
    out = triton_ops.rms_norm(x, norm.weight, norm.eps)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)


def test_rotary_matches_module():
    gen = torch.Generator().manual_seed(1)
    rope = RotaryEmbedding(32, 64, 10000.0)
    positions = torch.tensor([0, 3, 17, 63])
    table = rope.table(positions)
    qkv = torch.randn(4, 7 * 32, generator=gen)
    x = qkv[:, : 6 * 32].view(4, 6, 32)  # q and k heads of a fused projection (strided rows)
    ref = rope.rotate(x, table)  # CPU: the torch path
    out = triton_ops.rotary(x, table.cos, table.sin)
    torch.testing.assert_close(out, ref, atol=1e-6, rtol=1e-6)


def test_cpu_tensors_never_dispatch_to_triton():
    assert not triton_ops.available(torch.zeros(2))


def test_silu_mul_matches_torch():
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(3, 2 * 1500, generator=gen) * 4  # not a multiple of the block
    gate, up = x.split(1500, dim=-1)
    ref = torch.nn.functional.silu(gate) * up
    torch.testing.assert_close(triton_ops.silu_mul(x), ref, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("hidden", [64, 96])
def test_add_rms_norm_matches_unfused(hidden):
    """The fused residual add + norm against the torch path (the add, then the module)."""
    gen = torch.Generator().manual_seed(3)
    norm = _random_norm(hidden, 1e-6, gen)
    x = torch.randn(6, 2 * hidden, generator=gen)[:, :hidden] * 2  # a strided view
    residual = torch.randn(6, hidden, generator=gen) * 5
    ref_out, ref_res = norm.add_and_norm(x, residual)  # CPU: the torch path
    torch.testing.assert_close(ref_res, x + residual, atol=0, rtol=0)
    torch.testing.assert_close(ref_out, norm(x + residual), atol=0, rtol=0)
    out, res = triton_ops.add_rms_norm(x, residual, norm.weight, norm.eps)
    torch.testing.assert_close(res, ref_res, atol=0, rtol=0)  # one float32 add: exact
    torch.testing.assert_close(out, ref_out, atol=1e-5, rtol=1e-5)
    assert out.data_ptr() != x.data_ptr() and res.data_ptr() != residual.data_ptr()


@pytest.mark.parametrize("rows,cols,bias,config", [(48, 64, False, (2, 32, 4, 3)),
                                                   (51, 70, True, (16, 32, 4, 1)),
                                                   (6, 5000, True, (2, 2048, 8, 3)),
                                                   (5, 20, False, (2, 32, 4, 1))])
def test_gemv_matches_linear(rows, cols, bias, config):
    """One-row GEMV: even and uneven shapes (row tail, column tail, several column blocks, one
    partial block: the peeled first block alone)."""
    gen = torch.Generator().manual_seed(4)
    layer = torch.nn.Linear(cols, rows, bias=bias)
    x = torch.randn(2, cols, generator=gen)[1:]  # [1, K], a view
    out = triton_ops.gemv(x, layer.weight, layer.bias, config)
    torch.testing.assert_close(out, layer(x), atol=1e-4, rtol=1e-4)


def test_linear_dispatches_only_one_cuda_half_row():
    """CPU (and float32, and several rows) keep the module's own product."""
    layer = torch.nn.Linear(8, 4)
    x = torch.randn(1, 8)
    assert torch.equal(triton_ops.linear(layer, x), layer(x))


@pytest.mark.parametrize("variant,block_n,block_k,per_program", [
    ("fma", 2, 32, 0), ("fma", 4, 64, 0), ("dot", 16, 32, 0), ("dot", 32, 64, 0),
    ("fma", 4, 32, 3), ("dot", 32, 64, 24), ("dot", 16, 32, 5)])
@pytest.mark.parametrize("rows,cols,bias", [(48, 64, False), (51, 70, True), (9, 20, False)])
def test_gemv_rows_matches_matmul(variant, block_n, block_k, per_program, rows, cols, bias):
    """Multi-row GEMV (layers/gemv.py), both variants, M = 1..16 (each row bucket, and M not a
    power of two: padded rows must be neither read nor written), even and uneven N and K, and
    programs covering fewer weight rows than their tile (rows_per_program: the tile's other
    rows belong to the next program and must be neither summed nor written here)."""
    gen = torch.Generator().manual_seed(5)
    weight = torch.randn(rows, cols, generator=gen)  # [N, K]
    b = torch.randn(rows, generator=gen) if bias else None
    config = gemv.RowsConfig(variant, block_n, block_k, 4, 1, per_program)
    for num_m in range(1, gemv.MAX_ROWS + 1):
        x = torch.randn(num_m, 2 * cols, generator=gen)[:, :cols]  # [M, K], strided rows
        ref = x.double() @ weight.double().T + (b.double() if bias else 0)  # [M, N]
        out = gemv.gemv_rows(x, weight, b, config)
        assert out.shape == (num_m, rows) and out.dtype == x.dtype
        torch.testing.assert_close(out.double(), ref, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("variant", ["fma", "dot"])
def test_gemv_rows_half_precision(variant):
    """fp16 in and out (the interpreter's bf16 dot is wrong, see triton_kernels.py), float32
    sums: within fp16 rounding of the float64 product."""
    gen = torch.Generator().manual_seed(6)
    weight = (torch.randn(40, 96, generator=gen) * 0.1).half()
    x = torch.randn(9, 96, generator=gen).half()
    out = gemv.gemv_rows(x, weight, None, gemv.RowsConfig(variant, 16, 32, 4, 1))
    assert out.dtype == torch.float16
    torch.testing.assert_close(out.double(), x.double() @ weight.double().T, atol=2e-3,
                               rtol=2e-3)


def test_linear_dispatch(monkeypatch):
    """With the kernels allowed (as on CUDA), ``linear`` sends 2..MAX_ROWS half rows of a
    configured shape and bucket to gemv_rows, one row to the one-row gemv, and everything else
    (unconfigured shape or bucket, more rows, float32, a 3-d input) to the module."""
    gen = torch.Generator().manual_seed(7)
    layer = torch.nn.Linear(64, 48, bias=True).half()
    calls: list[str] = []
    real_rows, real_one = gemv.gemv_rows, triton_ops.gemv
    monkeypatch.setattr(triton_ops, "available", lambda x: True)
    monkeypatch.setattr(gemv, "gemv_rows",
                        lambda *a: calls.append("rows") or real_rows(*a))
    monkeypatch.setattr(triton_ops, "gemv", lambda *a: calls.append("one") or real_one(*a))
    monkeypatch.setitem(triton_ops.GEMV_CONFIGS, (48, 64), (16, 32, 4, 1))
    for bucket in (2, 4, 8):  # no bucket-16 config: 9..16 rows keep the module
        monkeypatch.setitem(gemv.ROWS_CONFIGS, (48, 64, bucket),
                            gemv.RowsConfig("dot", 16, 32, 4, 1))

    def route(x: torch.Tensor, module: torch.nn.Linear = layer) -> str | None:
        calls.clear()
        out = triton_ops.linear(module, x)
        ref = torch.nn.functional.linear(x.float(), module.weight.float(), module.bias.float())
        torch.testing.assert_close(out.float(), ref, atol=3e-3, rtol=3e-3)
        return calls[0] if calls else None

    half = torch.randn(17, 64, generator=gen).half()
    assert route(half[:1]) == "one"
    assert [route(half[:m]) for m in range(2, 9)] == ["rows"] * 7
    assert [route(half[:m]) for m in (9, 16, 17)] == [None] * 3
    assert route(half[:3].float(), torch.nn.Linear(64, 48)) is None
    assert route(half[:4].view(2, 2, 64)) is None
    monkeypatch.delitem(gemv.ROWS_CONFIGS, (48, 64, 4))
    assert route(half[:3]) is None and route(half[:2]) == "rows"


def test_pdl_is_for_cuda_tensors_only():
    """CPU tensors (the interpreter) never get programmatic dependent launch."""
    from specserve.model.layers import pdl

    assert pdl.launch_options(torch.zeros(1)) == {"PDL": False}
