"""Fused decode kernels against their unfused paths, on CPU under the Triton interpreter (see
test_triton_attention.py for why TRITON_INTERPRET is set here):

* TritonAttentionBackend.rotate_and_write_kv (rotary + KV-cache write in one kernel) against
  the base class's path (the rotary module's rotate, then write_kv) and the torch backend;
* fused_mlp.gate_up_silu (silu_mul in the one-row gate_up GEMV) against gemv then silu_mul;
* a tiny Llama through the Triton backend, fused vs unfused vs the torch backend;
* fused_argmax (the greedy head's argmax) against torch.argmax, ties and NaN included.
"""

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

from specserve.model.layers import fused_mlp, gemv, triton_ops  # noqa: E402
from specserve.model.layers.attention.metadata import AttentionMetadata  # noqa: E402
from specserve.model.layers.attention.torch_backend import TorchAttentionBackend  # noqa: E402
from specserve.model.layers.attention.triton_backend import TritonAttentionBackend  # noqa: E402
from specserve.model.layers.rotary import RotaryEmbedding  # noqa: E402
from specserve.worker.cuda_graphs import PAD_SLOT  # noqa: E402

PAGE = 4
NUM_BLOCKS = 6


def _meta(slots: list[int]) -> AttentionMetadata:
    """Metadata for a batch that only writes KV (the write paths read slot_mapping alone)."""
    n = len(slots)
    return AttentionMetadata(
        slot_mapping=torch.tensor(slots, dtype=torch.int64),
        block_tables=torch.zeros(1, 1, dtype=torch.int32),
        seq_lens=torch.tensor([n], dtype=torch.int32),
        query_start_loc=torch.tensor([0, n], dtype=torch.int32),
        query_lens=[n], seq_lens_host=[n], max_query_len=n, max_seq_len=n, block_size=PAGE)


def _assert_same_rounding(got: torch.Tensor, want: torch.Tensor) -> None:
    """Bit-equal in float32. In bf16 within one unit in the last place: the interpreter casts
    float32 to bf16 by truncation, where torch and the GPU round to nearest (the GPU check,
    tests/gpu/check_fused_decode.py, compares the bits)."""
    if got.dtype == torch.float32:
        assert torch.equal(got, want)
    else:
        torch.testing.assert_close(got, want, atol=0, rtol=2.0**-7)


def _rotate_and_write(backend, qkv, rope, table, caches, slots):
    k_cache, v_cache = caches[0].clone(), caches[1].clone()
    q = backend.rotate_and_write_kv(qkv, rope, table, k_cache, v_cache, _meta(slots))
    return q, k_cache, v_cache


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("heads,kv_heads,head_dim", [(4, 2, 16), (8, 2, 32), (2, 2, 24),
                                                     (4, 1, 16)])
def test_rotary_write_kv_matches_unfused(heads, kv_heads, head_dim, dtype):
    """GQA and MHA, a head_dim whose half is no power of two, a strided qkv, padded slots."""
    gen = torch.Generator().manual_seed(heads * 100 + head_dim)
    rope = RotaryEmbedding(head_dim, 128, 10000.0)
    slots = [5, PAD_SLOT, 17, 0, PAD_SLOT, 22]
    positions = torch.tensor([3, 0, 77, 1, 127, 40])
    table = rope.table(positions)
    width = (heads + 2 * kv_heads) * head_dim
    qkv = (torch.randn(len(slots), width + 8, generator=gen) * 2).to(dtype)[:, 3:width + 3]
    # Non-zero junk in the caches: a skipped slot must keep it, a written one must replace it.
    caches = [torch.randn(NUM_BLOCKS, PAGE, kv_heads, head_dim, generator=gen).to(dtype)
              for _ in range(2)]
    fused = _rotate_and_write(TritonAttentionBackend(num_sms=4), qkv, rope, table, caches, slots)
    unfused = _rotate_and_write(TritonAttentionBackend(num_sms=4, fused_rotary_kv=False), qkv,
                                rope, table, caches, slots)
    # The torch backend (the CPU reference) has no padded slots: give it the real rows only.
    real = torch.tensor([s != PAD_SLOT for s in slots])
    torch_ref = _rotate_and_write(TorchAttentionBackend(), qkv[real], rope,
                                  rope.table(positions[real]), caches,
                                  [s for s in slots if s != PAD_SLOT])
    for got, want in zip(fused, unfused, strict=True):
        assert got.shape == want.shape and got.dtype == want.dtype
        _assert_same_rounding(got, want)
    _assert_same_rounding(fused[0][real], torch_ref[0])
    _assert_same_rounding(fused[1], torch_ref[1])
    assert torch.equal(fused[2], torch_ref[2])  # values are copied, never rounded
    flat_before = caches[0].view(-1, kv_heads, head_dim)
    flat_after = fused[1].view(-1, kv_heads, head_dim)
    changed = (flat_after != flat_before).any(dim=(1, 2)).nonzero().flatten().tolist()
    assert changed == sorted(s for s in slots if s != PAD_SLOT)


def test_rotary_write_kv_partial_rotary_dim_falls_back():
    """A rotary dim below head_dim is not the kernel's layout: the base path serves it."""
    gen = torch.Generator().manual_seed(7)
    rope = RotaryEmbedding(16, 64, 10000.0, rotary_dim=8)
    table = rope.table(torch.tensor([2, 9]))
    qkv = torch.randn(2, (2 + 2) * 16, generator=gen)
    caches = [torch.zeros(NUM_BLOCKS, PAGE, 1, 16) for _ in range(2)]
    fused = _rotate_and_write(TritonAttentionBackend(num_sms=4), qkv, rope, table, caches, [1, 6])
    ref = _rotate_and_write(TorchAttentionBackend(), qkv, rope, table, caches, [1, 6])
    for got, want in zip(fused, ref, strict=True):
        assert torch.equal(got, want)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("inter,cols,config", [(24, 64, (2, 32, 4, 1)),
                                               (20, 70, (8, 32, 4, 1)),
                                               (3, 5000, (2, 2048, 8, 3)),
                                               (4, 20, (2, 32, 4, 1))])
def test_gate_up_silu_matches_gemv_then_silu_mul(inter, cols, config, dtype):
    """Even and uneven shapes (activation tail, column tail, several column blocks)."""
    gen = torch.Generator().manual_seed(inter + cols)
    weight = (torch.randn(2 * inter, cols, generator=gen) / cols**0.5).to(dtype)
    x = (torch.randn(2, cols, generator=gen) * 3).to(dtype)[1:]  # [1, K], a view
    out = fused_mlp.gate_up_silu(x, weight, config)
    unfused = triton_ops.silu_mul(triton_ops.gemv(x, weight, None, config))
    assert out.shape == (1, inter) and out.dtype == dtype
    assert torch.equal(out, unfused)
    gate, up = (x @ weight.T).split(inter, dim=-1)  # the torch path
    torch.testing.assert_close(out, torch.nn.functional.silu(gate) * up,
                               **({"atol": 1e-5, "rtol": 1e-5} if dtype == torch.float32
                                  else {"atol": 2e-2, "rtol": 2e-2}))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("variant,block_n,block_k,per_program", [
    ("fma", 2, 32, 0), ("fma", 4, 64, 0), ("dot", 16, 32, 0), ("dot", 32, 64, 0),
    ("fma", 4, 32, 2), ("dot", 32, 64, 22)])
@pytest.mark.parametrize("inter,cols", [(24, 64), (20, 70), (9, 20)])
def test_gate_up_silu_rows_matches_gemv_rows_then_silu_mul(inter, cols, variant, block_n,
                                                           block_k, per_program, dtype):
    """The multi-row fused kernel (verification steps) at M = 2..16, even and uneven shapes
    (activation tail, column tail), against gemv_rows then silu_mul: bit for bit where the
    interpreter's sums are row-order independent (fma); the interpreter's dot (numpy's matmul)
    may sum a permuted tile in another order, so there within float32 rounding, x16 for fp16."""
    gen = torch.Generator().manual_seed(inter + cols)
    weight = (torch.randn(2 * inter, cols, generator=gen) / cols**0.5).to(dtype)
    config = gemv.RowsConfig(variant, block_n, block_k, 4, 1, per_program)
    for num_m in (2, 3, 5, 9, 16):
        x = (torch.randn(num_m, 2 * cols, generator=gen) * 3).to(dtype)[:, :cols]  # strided
        out = gemv.gate_up_silu_rows(x, weight, config)
        unfused = triton_ops.silu_mul(gemv.gemv_rows(x, weight, None, config))
        assert out.shape == (num_m, inter) and out.dtype == dtype
        if variant == "fma":
            assert torch.equal(out, unfused)
        else:
            tol = 2e-5 if dtype == torch.float32 else 2e-3
            torch.testing.assert_close(out, unfused, atol=tol, rtol=tol)
        gate, up = (x.double() @ weight.double().T).split(inter, dim=-1)
        torch.testing.assert_close(out.double(), torch.nn.functional.silu(gate) * up,
                                   **({"atol": 1e-4, "rtol": 1e-4} if dtype == torch.float32
                                      else {"atol": 2e-2, "rtol": 2e-2}))


def test_fused_mlp_rows_path_serves_only_what_gemv_rows_serves(monkeypatch):
    """2..16 half rows of a shape and bucket listed in gemv.ROWS_CONFIGS with an even block,
    on the kernel path (CUDA: forced here), without bias; the one-row path stays separate."""
    layer = torch.nn.Linear(64, 48, bias=False).to(torch.float16)
    rows = torch.randn(3, 64, dtype=torch.float16)
    assert fused_mlp.rows_config_for(layer, rows) is None  # CPU
    monkeypatch.setattr(triton_ops, "available", lambda t: True)
    assert fused_mlp.rows_config_for(layer, rows) is None  # shape not listed
    config = gemv.RowsConfig("dot", 16, 32, 4, 1)
    monkeypatch.setitem(gemv.ROWS_CONFIGS, (48, 64, 4), config)
    assert fused_mlp.rows_config_for(layer, rows) == config
    assert fused_mlp.rows_config_for(layer, rows[:2]) is None  # bucket 2 not listed
    assert fused_mlp.rows_config_for(layer, rows[:1]) is None  # one row: config_for's
    assert fused_mlp.rows_config_for(layer.float(), rows.float()) is None
    biased = torch.nn.Linear(64, 48, bias=True).to(torch.float16)
    assert fused_mlp.rows_config_for(biased, rows) is None
    monkeypatch.setitem(gemv.ROWS_CONFIGS, (48, 64, 4), gemv.RowsConfig("fma", 3, 32, 4, 1))
    assert fused_mlp.rows_config_for(layer, rows) is None  # odd block: no gate/up pairs
    monkeypatch.setitem(gemv.ROWS_CONFIGS, (48, 64, 4), gemv.RowsConfig("dot", 16, 32, 4, 1, 7))
    assert fused_mlp.rows_config_for(layer, rows) is None  # odd rows per program: the same
    monkeypatch.setitem(gemv.ROWS_CONFIGS, (48, 64, 4), config)
    monkeypatch.setattr(fused_mlp, "ROWS_ENABLED", False)
    assert fused_mlp.rows_config_for(layer, rows) is None
    monkeypatch.setattr(fused_mlp, "ROWS_ENABLED", True)
    monkeypatch.setattr(fused_mlp, "ENABLED", False)
    assert fused_mlp.rows_config_for(layer, rows) is None


def test_fused_mlp_serves_only_what_the_gemv_serves(monkeypatch):
    layer = torch.nn.Linear(64, 48, bias=False).to(torch.bfloat16)
    x = torch.randn(1, 64, dtype=torch.bfloat16)
    assert fused_mlp.config_for(layer, x) is None  # CPU
    monkeypatch.setattr(triton_ops, "available", lambda t: True)
    assert fused_mlp.config_for(layer, x) is None  # shape not listed
    monkeypatch.setitem(fused_mlp.GATE_UP_CONFIGS, (48, 64), (2, 32, 4, 1))
    assert fused_mlp.config_for(layer, x) == (2, 32, 4, 1)
    assert fused_mlp.config_for(layer, torch.randn(2, 64, dtype=torch.bfloat16)) is None
    assert fused_mlp.config_for(layer.float(), x.float()) is None
    monkeypatch.setattr(fused_mlp, "ENABLED", False)
    assert fused_mlp.config_for(layer.to(torch.bfloat16), x) is None


def _random_llama_mlp(dtype: torch.dtype, rows: int, seed: int):
    """A LlamaMLP (hidden 64, intermediate 96: gate_up [192, 64], down [64, 96]) with random
    weights, and an input [rows, 64], both in dtype."""
    from transformers import LlamaConfig

    from specserve.model.llama import LlamaMLP

    mlp = LlamaMLP(LlamaConfig(hidden_size=64, intermediate_size=96)).to(dtype)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in mlp.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.2)
    return mlp, torch.randn(rows, 64, generator=gen).to(dtype)


def test_llama_mlp_fused_matches_unfused(monkeypatch):
    """LlamaMLP at one bf16 row with the kernels forced on (CPU, interpreted): the fused
    gate_up + silu path gives the unfused gemv, silu_mul, gemv bits."""
    mlp, x = _random_llama_mlp(torch.bfloat16, 1, seed=11)
    reference = mlp(x)  # CPU: the torch path
    monkeypatch.setattr(triton_ops, "available", lambda t: True)
    monkeypatch.setitem(triton_ops.GEMV_CONFIGS, (192, 64), (2, 32, 4, 1))
    monkeypatch.setitem(triton_ops.GEMV_CONFIGS, (64, 96), (2, 32, 4, 1))
    monkeypatch.setitem(fused_mlp.GATE_UP_CONFIGS, (192, 64), (2, 32, 4, 1))
    fused = mlp(x)
    monkeypatch.setattr(fused_mlp, "ENABLED", False)
    unfused = mlp(x)
    assert torch.equal(fused, unfused)
    torch.testing.assert_close(fused, reference, atol=3e-2, rtol=3e-2)


def test_llama_mlp_fused_rows_match_unfused(monkeypatch):
    """LlamaMLP at 3 fp16 rows (a k = 2 verification) with the multi-row kernels forced on:
    the fused gate_up + silu kernel gives the bits of gemv_rows, silu_mul, gemv_rows ("fma": the
    interpreter sums it in the same order either way), and the kernel is really called."""
    mlp, x = _random_llama_mlp(torch.float16, 3, seed=12)
    monkeypatch.setattr(triton_ops, "available", lambda t: True)
    for shape in ((192, 64), (64, 96)):
        monkeypatch.setitem(gemv.ROWS_CONFIGS, (*shape, 4), gemv.RowsConfig("fma", 2, 32, 4, 1))
    calls = []
    real = gemv.gate_up_silu_rows
    monkeypatch.setattr(gemv, "gate_up_silu_rows", lambda *a: calls.append(1) or real(*a))
    fused = mlp(x)
    assert calls == [1]
    monkeypatch.setattr(fused_mlp, "ROWS_ENABLED", False)
    unfused = mlp(x)
    assert calls == [1]
    assert torch.equal(fused, unfused)
    gate, up = (x.double() @ mlp.gate_up_proj.weight.double().T).split(96, dim=-1)
    reference = (torch.nn.functional.silu(gate) * up) @ mlp.down_proj.weight.double().T
    torch.testing.assert_close(fused.double(), reference, atol=3e-2, rtol=3e-2)


def test_llama_forward_fused_matches_unfused_and_torch(tiny_llama, monkeypatch, single_thread):
    """A tiny Llama on the Triton backend (fused rotary + KV write) vs the same backend unfused
    (bit for bit) and vs the torch backend: prefill, then decode and verify runs, then the padded
    graph path (padded tokens write no KV)."""
    from helpers import cpu_runner

    from specserve.worker.model_runner import SequenceRun

    prompts = [[5, 6, 7, 8, 9, 10], [11, 12, 13]]
    tables = [[3, 4, 5], [8, 9]]
    steps = [[SequenceRun(p, 0, t, [len(p) - 1]) for p, t in zip(prompts, tables, strict=True)],
             [SequenceRun([1], 6, tables[0], [0]), SequenceRun([2, 3, 4], 3, tables[1], [0, 1, 2])]]

    def run(backend: str, fused: bool = True, padded: bool = False) -> list[torch.Tensor]:
        monkeypatch.setenv("SPECSERVE_ATTENTION_BACKEND", backend)
        runner = cpu_runner(tiny_llama, 4, 16)
        if backend == "triton":
            runner.backend.fused_rotary_kv = fused
        outs = [runner.execute(steps[0])]
        if padded:
            assert runner.enable_cuda_graphs(max_batch=4, max_query_len=3, max_model_len=32,
                                             capture=False)
        outs.append(runner.execute(steps[1]))
        caches = [(layer.k_cache, layer.v_cache) for layer in runner.model.attention_layers()]
        return outs + [torch.stack([c for kv in caches for c in kv])]

    fused = run("triton")
    unfused = run("triton", fused=False)
    reference = run("torch")
    for got, want, ref in zip(fused, unfused, reference, strict=True):
        assert torch.equal(got, want)
        torch.testing.assert_close(got, ref, atol=1e-4, rtol=1e-4)
    padded = run("triton", padded=True)
    torch.testing.assert_close(padded[1], fused[1], atol=1e-4, rtol=1e-4)
    # Padded rows wrote nothing: the same slots hold K/V (the values may differ in the last
    # float32 bits, as a 12-row projection need not round like a 4-row one).
    torch.testing.assert_close(padded[2], fused[2], atol=1e-5, rtol=1e-5)
    assert torch.equal(padded[2] != 0, fused[2] != 0)


def test_argmax_kernels_match_torch():
    """Ties (lowest index wins, within and across blocks), NaN (first NaN wins, as torch),
    infinities, a row of -inf, a partial last block, several rows and a strided view."""
    from specserve.model.layers import fused_argmax

    gen = torch.Generator().manual_seed(12)
    cols = 3 * fused_argmax.BLOCK + 77
    x = torch.randn(7, cols + 5, generator=gen)[:, 2:cols + 2]  # rows of a wider tensor
    x[1, [5, 900, fused_argmax.BLOCK + 3]] = 50.0  # tie inside a block and across blocks
    x[2, [fused_argmax.BLOCK + 1, 2 * fused_argmax.BLOCK + 9]] = 60.0  # tie across blocks only
    x[3, [17, 2 * fused_argmax.BLOCK]] = float("nan")
    x[3, 3] = float("inf")
    x[4] = float("-inf")
    x[5, cols - 1] = 99.0  # the last column of the partial block
    x[6, [4, 2 * fused_argmax.BLOCK + 4]] = float("inf")
    want = x.argmax(dim=-1)
    assert want.tolist()[:4] == [want[0].item(), 5, fused_argmax.BLOCK + 1, 17]
    assert torch.equal(fused_argmax.argmax(x), want)
    assert torch.equal(fused_argmax.argmax(x.to(torch.bfloat16)), x.to(torch.bfloat16).argmax(-1))
    assert torch.equal(fused_argmax.logits_argmax(x), want)  # CPU: torch's own
