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

from specserve.model.layers import triton_ops  # noqa: E402
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
                                                   (6, 5000, True, (2, 2048, 8, 3))])
def test_gemv_matches_linear(rows, cols, bias, config):
    """One-row GEMV: even and uneven shapes (row tail, column tail, several column blocks)."""
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
