"""The two-stage Triton argmax of the greedy path (layers/argmax.py) against torch.argmax, on
CPU under the Triton interpreter (see test_triton_attention.py for why the variable is set)."""

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

from specserve.model.layers import argmax as argmax_module  # noqa: E402


@pytest.mark.parametrize("vocab", [7, 4096, 4097, 49152, 128256])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_equals_torch_argmax_with_ties(vocab, dtype):
    gen = torch.Generator().manual_seed(vocab)
    # few distinct values: many ties, inside and across chunks; the first index must win
    logits = torch.randint(-3, 4, (5, vocab), generator=gen).to(dtype)
    logits[1] = -1.0
    logits[2, -1] = 10.0  # the maximum in the last, partial chunk
    logits[3] = float("-inf")
    got = argmax_module.triton_argmax(logits)
    assert got.dtype == torch.int64
    assert got.tolist() == logits.argmax(dim=-1).tolist()


def test_strided_rows_and_random_values():
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(3, 2 * 9000, generator=gen)[:, :9000]  # rows of a wider tensor
    assert argmax_module.triton_argmax(logits).tolist() == logits.argmax(-1).tolist()


def test_cpu_tensors_keep_torch():
    """Off CUDA the engine path is torch's argmax (the kernel runs on CPU only in tests)."""
    logits = torch.randn(2, 100)
    assert argmax_module.argmax(logits).tolist() == logits.argmax(-1).tolist()
