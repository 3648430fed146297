"""The C++ CPU kernels (specserve/model/layers/csrc) against the torch ops they replace.

GGUF block products must equal a float64 product with the dequantizer's float32 weights to
float32 rounding (they compute the same sums in another order), for every row count the tiling
distinguishes and output widths that leave tails; the norm kernels must match Hugging Face's
RMSNorm op sequence.
"""

from __future__ import annotations

import pytest
import torch
from gguf import GGMLQuantizationType as QT
from helpers import gguf_blocks

from specserve.model.layers import cpu_kernels
from specserve.model.layers.norm import RMSNorm

kernels = cpu_kernels.load()
pytestmark = pytest.mark.skipif(
    kernels is None, reason="the CPU kernels did not build (no C++ compiler?); see the log")

# every tile of rows (1-11) and tilings past it: 12 = 6 + 6, 23 = 8 + 8 + 7, 34 = 9 + 9 + 9 + 7
ROW_COUNTS = [1, 2, 3, 4, 5, 7, 8, 9, 10, 11, 12, 16, 17, 23, 34]


@pytest.mark.parametrize("qtype,kernel", [(QT.Q4_1, "q4_1_linear"), (QT.Q8_0, "q8_0_linear")])
@pytest.mark.parametrize("out_features", [7, 64, 131])  # below, at and past a parallel chunk
def test_block_linear_equals_dequantized_matmul(qtype, kernel, out_features):
    raw, dense = gguf_blocks(qtype, out_features, 96, seed=out_features)
    fn = getattr(kernels, kernel)
    gen = torch.Generator().manual_seed(1)
    for rows in ROW_COUNTS:
        x = torch.randn(rows, 96, generator=gen)
        got = fn(x, raw)  # [rows, N]
        ref = x.double() @ dense.double().t()
        scale = x.abs().double() @ dense.abs().double().t()  # bound on the rounding
        assert got.shape == (rows, out_features) and got.dtype == torch.float32
        assert ((got.double() - ref).abs() <= 1e-6 * scale + 1e-7).all(), rows



@pytest.mark.parametrize("qtype,kernel", [(QT.Q4_1, "q4_1_linear"), (QT.Q8_0, "q8_0_linear")])
def test_block_linear_bits_do_not_depend_on_the_column_tiling(qtype, kernel):
    """An output's summation order depends only on how many rows of x share its tile: the same
    weight row gives the same bits whether it sits in a full group of columns or in a panel's
    tail (a slice of the matrix moves it there). So retuning the columns per tile, or cutting
    a matrix into shards, never changes a model's outputs."""
    raw, _ = gguf_blocks(qtype, 96, 96, seed=4)
    fn = getattr(kernels, kernel)
    gen = torch.Generator().manual_seed(5)
    for rows in ROW_COUNTS:
        x = torch.randn(rows, 96, generator=gen)
        whole = fn(x, raw)  # [rows, 96]
        for n in (1, 2, 3, 5, 7):
            assert torch.equal(fn(x, raw[:n].contiguous()), whole[:, :n]), (rows, n)


@pytest.mark.parametrize("qtype,kernel", [(QT.Q4_1, "q4_1_linear"), (QT.Q8_0, "q8_0_linear")])
def test_block_linear_bits_do_not_depend_on_how_many_rows_verify(qtype, kernel):
    """From 3 rows of x on, every tile holds 3 or more rows (rows_per_tile spreads them evenly
    over tiles of up to 11), and such tiles all sum in one order: a row's outputs have the same
    bits whether 3 or 34 rows pass together. (With tiles of 8 and the rest, a 9-row pass put its
    last row alone in a tile that sums in two halves.)"""
    raw, _ = gguf_blocks(qtype, 40, 96, seed=6)
    fn = getattr(kernels, kernel)
    x = torch.randn(34, 96, generator=torch.Generator().manual_seed(7))
    whole = fn(x, raw)  # [34, 40]
    for rows in range(3, 34):
        assert torch.equal(fn(x[:rows], raw), whole[:rows]), rows


def test_block_linear_rejects_bad_shapes():
    raw, _ = gguf_blocks(QT.Q4_1, 8, 64, seed=0)
    with pytest.raises(RuntimeError, match="wrong number of bytes"):
        kernels.q4_1_linear(torch.randn(2, 96), raw)
    with pytest.raises(RuntimeError, match="float32"):
        kernels.q4_1_linear(torch.randn(2, 64, dtype=torch.float64), raw)


def test_block_linear_wrong_decoding_would_fail():
    """Power check: the tolerance above is tight enough to see a one-code error in one block."""
    raw, dense = gguf_blocks(QT.Q4_1, 16, 64, seed=3)
    broken = raw.clone()
    broken[5, 4 + 3] ^= 1  # one 4-bit code of row 5, block 0
    x = torch.randn(1, 64, generator=torch.Generator().manual_seed(2))
    got = kernels.q4_1_linear(x, broken)
    ref = x.double() @ dense.double().t()
    scale = x.abs().double() @ dense.abs().double().t()
    assert not ((got.double() - ref).abs() <= 1e-6 * scale + 1e-7).all()


@pytest.mark.parametrize("hidden", [64, 72])  # whole vectors of 16, and a tail
@pytest.mark.parametrize("rows", [1, 3, 40])  # 40: several parallel tasks
def test_rms_norm_matches_hf_op_sequence(hidden, rows):
    gen = torch.Generator().manual_seed(hidden + rows)
    x, residual = torch.randn(rows, hidden, generator=gen), torch.randn(rows, hidden, generator=gen)
    weight, eps = torch.randn(hidden, generator=gen), 1e-5

    def hf(h):  # LlamaRMSNorm.forward in float32
        return weight * (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps))

    torch.testing.assert_close(kernels.rms_norm(x, weight, eps), hf(x), rtol=1e-6, atol=1e-6)
    normed, summed = kernels.add_rms_norm(x, residual, weight, eps)
    assert torch.equal(summed, x + residual)
    torch.testing.assert_close(normed, hf(x + residual), rtol=1e-6, atol=1e-6)


def test_rms_norm_module_uses_the_kernel(monkeypatch):
    norm = RMSNorm(64, 1e-6)
    calls = []
    real = kernels.add_rms_norm
    monkeypatch.setattr(kernels, "add_rms_norm",
                        lambda *a, **kw: calls.append(1) or real(*a, **kw))
    x, residual = torch.randn(2, 64), torch.randn(2, 64)
    out, summed = norm.add_and_norm(x, residual)
    assert calls and torch.equal(summed, x + residual)


def _runs_reference(q, k, v, starts, lens, scale):
    """SDPA per sequence with the kernel's mask: query i of a run of length n in a sequence of
    length L sees keys [0, L - n + i]; KV heads repeated for grouped queries (HF's mapping)."""
    outs = []
    group = q.shape[1] // k.shape[1]
    for s in range(k.shape[0]):
        n, length = starts[s + 1] - starts[s], lens[s]
        allowed = torch.ones(n, length, dtype=torch.bool).tril_(length - n)
        out = torch.nn.functional.scaled_dot_product_attention(
            q[starts[s]:starts[s + 1]].transpose(0, 1), k[s, :, :length].repeat_interleave(group, 0),
            v[s, :, :length].repeat_interleave(group, 0), attn_mask=allowed, scale=scale)
        outs.append(out.transpose(0, 1))  # [n, H, D]
    return torch.cat(outs)


@pytest.mark.parametrize("heads,kv_heads,head_dim,runs", [
    (9, 3, 64, [(1, 300)]),  # SmolLM2 decode
    (9, 3, 64, [(6, 420)]),  # SmolLM2 verification of 5 proposals
    (8, 2, 128, [(1, 17), (4, 40), (2, 2), (0, 5)]),  # mixed runs, an empty one, a tail of 16
    (4, 4, 16, [(1, 1), (1, 33), (16, 16)]),  # one key; no grouping; a run as long as its context
    (9, 3, 64, [(150, 150), (1, 90), (70, 200)]),  # a whole prompt, a decode, a prompt chunk
])
def test_run_attention_matches_sdpa(heads, kv_heads, head_dim, runs):
    gen = torch.Generator().manual_seed(heads * head_dim)
    lens = [length for _, length in runs]
    starts = [0]
    for n, _ in runs:
        starts.append(starts[-1] + n)
    keys = max(lens) + 3  # contexts gathered to more keys than any sequence has
    q = torch.randn(starts[-1], heads, head_dim, generator=gen) * 2
    # [S, KvH, K, D] strided views of [S, K + 2, KvH, D] buffers, as the context mirror gives
    k = torch.randn(len(runs), keys + 2, kv_heads, head_dim, generator=gen)[:, :keys].transpose(1, 2)
    v = torch.randn(len(runs), keys + 2, kv_heads, head_dim, generator=gen)[:, :keys].transpose(1, 2)
    got = kernels.run_attention(q, k, v, torch.tensor(starts), torch.tensor(lens), 0.3)
    want = _runs_reference(q, k, v, starts, lens, 0.3)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-4)  # float32 summation order
    # each query row is computed alone: the last row of a run equals it as a one-token run
    last = starts[1] - 1
    if last >= 0:
        alone = kernels.run_attention(q[last:last + 1], k[:1], v[:1], torch.tensor([0, 1]),
                                      torch.tensor([lens[0]]), 0.3)
        assert torch.equal(alone[0], got[last])


def test_run_attention_row_bits_do_not_depend_on_the_run():
    """A query row gets the same bits whether it is attended in a whole prompt (split into
    blocks of rows inside the kernel), in a prompt chunk, in a verification run or alone as a
    decode: what makes a model's tokens independent of how the scheduler cut its steps."""
    gen = torch.Generator().manual_seed(11)
    heads, kv_heads, dim, length = 9, 3, 64, 200
    q = torch.randn(length, heads, dim, generator=gen)
    k = torch.randn(1, kv_heads, length, dim, generator=gen)
    v = torch.randn(1, kv_heads, length, dim, generator=gen)

    def run(first: int, last: int) -> torch.Tensor:  # rows [first, last) as one run
        return kernels.run_attention(q[first:last], k, v, torch.tensor([0, last - first]),
                                     torch.tensor([last]), 0.125)

    whole = run(0, length)  # [200, H, D], rows in blocks of 64
    # runs whose rows go in pairs (csrc/attention.cpp) across a 16-key group edge: (14, 19),
    # (31, 34), (78, 90), (15, 17)
    for first, last in [(0, 1), (63, 64), (64, 65), (100, 106), (130, 200), (5, 133), (14, 19),
                        (31, 34), (78, 90), (15, 17)]:
        assert torch.equal(run(first, last), whole[first:last]), (first, last)


def test_run_attention_rejects_bad_input():
    q = torch.randn(2, 4, 64)
    k = v = torch.randn(1, 2, 8, 64)
    with pytest.raises(RuntimeError, match="16, 32, 64 or 128"):
        kernels.run_attention(torch.randn(2, 4, 24), torch.randn(1, 2, 8, 24),
                              torch.randn(1, 2, 8, 24), torch.tensor([0, 2]), torch.tensor([8]), 1.0)
    with pytest.raises(RuntimeError, match="context length"):
        kernels.run_attention(q, k, v, torch.tensor([0, 2]), torch.tensor([9]), 1.0)  # > keys
    with pytest.raises(RuntimeError, match="end at the number of tokens"):
        kernels.run_attention(q, k, v, torch.tensor([0, 1]), torch.tensor([8]), 1.0)


def _argmax_cases():
    """Rows where torch.argmax's rules decide: ties (lowest index), NaN (first NaN wins), +-inf,
    all -inf (index 0), maxima in the vector part and in the tail, and strided rows."""
    gen = torch.Generator().manual_seed(0)
    cases = []
    for cols in (1, 15, 16, 17, 100, 49152):
        cases.append(torch.randn(3, cols, generator=gen))
        cases.append(torch.randint(-2, 2, (5, cols), generator=gen).float())  # many ties
        nan = torch.randn(2, cols, generator=gen)
        nan[0, cols // 2] = nan[0, -1] = float("nan")
        nan[1, -1] = float("nan")
        cases.append(nan)
        inf = torch.full((2, cols), -float("inf"))
        inf[1, -1] = float("inf")
        cases.append(inf)
        cases.append(torch.randn(4, cols + 3, generator=gen)[:, 1 : cols + 1])  # row stride
    return cases


def test_argmax_rows_equals_torch_argmax():
    for x in _argmax_cases():
        assert torch.equal(kernels.argmax_rows(x), x.argmax(dim=-1)), x.shape


def test_logits_argmax_uses_the_kernel_on_the_cpu(monkeypatch):
    """The greedy head of every CPU step (runner.execute_argmax) goes through the kernel, and a
    kernel that broke ties the other way would fail the check above: it is asked on ties."""
    from specserve.model.layers import fused_argmax

    calls = []
    real = kernels.argmax_rows
    monkeypatch.setattr(cpu_kernels, "load", lambda: type("K", (), {
        "argmax_rows": staticmethod(lambda x: calls.append(x.shape) or real(x))})())
    x = torch.tensor([[1.0, 3.0, 3.0, 0.0]])
    assert fused_argmax.logits_argmax(x).tolist() == [1]
    assert calls == [(1, 4)]


def test_argmax_rows_rejects_bad_input():
    with pytest.raises(RuntimeError, match="2-D float32"):
        kernels.argmax_rows(torch.zeros(4))
    with pytest.raises(RuntimeError, match="empty"):
        kernels.argmax_rows(torch.zeros(2, 0))
    with pytest.raises(RuntimeError, match="contiguous"):
        kernels.argmax_rows(torch.zeros(4, 2).t())


@pytest.mark.parametrize("rows,inter", [(1, 1536), (6, 1536), (3, 37), (70, 1536)])
def test_silu_mul_matches_torch(rows, inter):  # 37: a tail of 5 lanes; 70: several tasks
    gen = torch.Generator().manual_seed(rows + inter)
    gate_up = torch.randn(rows, 2 * inter, generator=gen) * 6
    gate_up[0, :4] = torch.tensor([0.0, -0.0, 90.0, -90.0])  # zeros, and exp's clamp either side
    exact = (torch.nn.functional.silu(gate_up[:, :inter].double()) * gate_up[:, inter:].double())
    out = kernels.silu_mul(gate_up)
    assert out.shape == (rows, inter)
    # within 4 float32 ulps (torch's own ops are within ~2 of the float64 value), or 1e-30
    torch.testing.assert_close(out.double(), exact, rtol=4.8e-7, atol=1e-30)
    # rows with a stride (a view of a wider tensor) give the same values
    wide = torch.cat([gate_up, torch.full((rows, 3), float("nan"))], dim=1)[:, :2 * inter]
    assert torch.equal(kernels.silu_mul(wide), out)


def test_silu_mul_power_and_nan():
    """A kernel that swapped gate and up, or dropped the sigmoid, would fail the check above;
    NaN propagates."""
    gate_up = torch.randn(2, 64)
    exact = torch.nn.functional.silu(gate_up[:, :32]) * gate_up[:, 32:]
    swapped = torch.nn.functional.silu(gate_up[:, 32:]) * gate_up[:, :32]
    assert not torch.allclose(swapped, exact, rtol=4.8e-7, atol=1e-30)
    assert not torch.allclose(gate_up[:, :32] * gate_up[:, 32:], exact, rtol=4.8e-7, atol=1e-30)
    gate_up[1, 5] = float("nan")
    out = kernels.silu_mul(gate_up)
    assert out[1, 5].isnan() and not out[0].isnan().any()


def test_silu_mul_rejects_bad_input():
    with pytest.raises(RuntimeError, match="even"):
        kernels.silu_mul(torch.zeros(2, 7))
    with pytest.raises(RuntimeError, match="float32"):
        kernels.silu_mul(torch.zeros(2, 8, dtype=torch.float64))
    with pytest.raises(RuntimeError, match="contiguous rows"):
        kernels.silu_mul(torch.zeros(8, 2).t())


def test_llama_mlp_uses_the_kernel_on_the_cpu(monkeypatch):
    from transformers import LlamaConfig

    from specserve.model.llama import LlamaMLP

    mlp = LlamaMLP(LlamaConfig(hidden_size=32, intermediate_size=48))
    calls = []
    real = kernels.silu_mul
    monkeypatch.setattr(cpu_kernels, "load", lambda: type("K", (), {
        "silu_mul": staticmethod(lambda x: calls.append(x.shape) or real(x))})())
    x = torch.randn(3, 32)
    with torch.no_grad():
        out = mlp(x)
        gate, up = mlp.gate_up_proj(x).split(48, dim=-1)
        torch.testing.assert_close(out, mlp.down_proj(torch.nn.functional.silu(gate) * up))
    assert calls == [(3, 96)]
