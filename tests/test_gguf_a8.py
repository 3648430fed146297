"""8-bit activations over GGUF blocks (``quantization="gguf_a8"``, csrc/gguf_a8_linear.cpp).

The kernel rounds each block of 32 inputs to dx * round(x / dx), dx = max|x| / 127, and then
multiplies exactly (integer dot products, one float rounding per block). So it must equal a
float64 product of the dequantized weights with that rounded x to float32 rounding; an output's
bits must depend only on its own row (speculative verification of k + 1 rows equals k + 1 decode
steps); and a model run this way must stay close to the float32 model (the rounding is the only
difference) while speculation over it stays exactly lossless.
"""

from __future__ import annotations

import pytest
import torch
from gguf import GGMLQuantizationType as QT
from helpers import gguf_blocks

from specserve.model.layers import cpu_kernels
from specserve.model.layers.quantization.gguf_a8 import PACKERS

kernels = cpu_kernels.load()
pytestmark = pytest.mark.skipif(
    kernels is None, reason="the CPU kernels did not build (no C++ compiler?); see the log")

ROW_COUNTS = [1, 2, 3, 4, 5, 6, 7, 8, 9, 16, 17]  # every tile size and remainders
FORMATS = [(QT.Q4_1, "Q4_1"), (QT.Q8_0, "Q8_0")]


def rounded(x: torch.Tensor) -> torch.Tensor:
    """x [M, K] with every block of 32 replaced by dx * round(x / dx), in float64."""
    blocks = x.double().view(x.shape[0], -1, 32)
    dx = (blocks.abs().amax(-1, keepdim=True).float() / 127).double()  # as the kernel: float32
    inv = torch.where(dx > 0, 1 / dx.float(), torch.zeros_like(dx.float()))
    codes = torch.round(x.view_as(blocks) * inv).clamp(-127, 127).double()
    return (codes * dx).view_as(x)


def a8(fmt: str, x: torch.Tensor, raw: torch.Tensor) -> torch.Tensor:
    return getattr(kernels, f"{fmt.lower()}_a8_linear")(x, PACKERS[fmt](raw), raw.shape[0])


@pytest.mark.parametrize("qtype,fmt", FORMATS)
@pytest.mark.parametrize("out_features", [7, 16, 48, 131])  # a part group, whole groups, tails
def test_a8_linear_equals_dequantized_times_rounded_x(qtype, fmt, out_features):
    raw, dense = gguf_blocks(qtype, out_features, 96, seed=out_features)
    gen = torch.Generator().manual_seed(1)
    for rows in ROW_COUNTS:
        x = torch.randn(rows, 96, generator=gen)
        x[0, :32] = 0.0  # an all-zero block (dx = 0)
        got = a8(fmt, x, raw)  # [rows, N]
        xr = rounded(x)
        ref = xr @ dense.double().t()
        scale = xr.abs() @ dense.abs().double().t()
        assert got.shape == (rows, out_features) and got.dtype == torch.float32
        assert ((got.double() - ref).abs() <= 1e-6 * scale + 1e-7).all(), rows
        # and it is an approximation of the float32 product, not something else
        exact = x.double() @ dense.double().t()
        assert ((got.double() - exact).norm() / exact.norm()) < 0.02


@pytest.mark.parametrize("qtype,fmt", FORMATS)
def test_a8_linear_bits_depend_only_on_the_row(qtype, fmt):
    """Each row of x is rounded on its own and accumulated in block order, whatever tile,
    thread or batch it lands in: a verification pass of r rows gives each row the bits a
    1-row pass gives it."""
    raw, _ = gguf_blocks(qtype, 131, 96, seed=4)
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(20, 96, generator=gen) * torch.logspace(-2, 2, 20)[:, None]
    alone = torch.cat([a8(fmt, x[i:i + 1], raw) for i in range(20)])
    for rows in ROW_COUNTS:
        assert torch.equal(a8(fmt, x[:rows], raw), alone[:rows]), rows


def test_a8_linear_wrong_code_would_fail():
    """Power check: the tolerance sees a one-code error in one weight block."""
    raw, dense = gguf_blocks(QT.Q4_1, 16, 64, seed=3)
    broken = raw.clone()
    broken[5, 4 + 3] ^= 1
    x = torch.randn(1, 64, generator=torch.Generator().manual_seed(2))
    got = a8("Q4_1", x, broken)
    xr = rounded(x)
    ref = xr @ dense.double().t()
    scale = xr.abs() @ dense.abs().double().t()
    assert not ((got.double() - ref).abs() <= 1e-6 * scale + 1e-7).all()


def test_a8_linear_rejects_bad_shapes():
    raw, _ = gguf_blocks(QT.Q4_1, 20, 64, seed=0)
    packed = PACKERS["Q4_1"](raw)  # [2 groups, 2 blocks, 320]
    with pytest.raises(RuntimeError, match="packed shape"):
        kernels.q4_1_a8_linear(torch.randn(2, 96), packed, 20)
    with pytest.raises(RuntimeError, match="groups"):
        kernels.q4_1_a8_linear(torch.randn(2, 64), packed, 40)
    with pytest.raises(RuntimeError, match="float32"):
        kernels.q4_1_a8_linear(torch.randn(2, 64, dtype=torch.float64), packed, 20)


# ---- SmolLM2 with quantization="gguf_a8" -----------------------------------------------------
REPEAT_PROMPT = ("Repeat this code exactly:\n\ndef fizzbuzz(n):\n    for i in range(1, n + 1):\n"
                 "        if i % 15 == 0:\n            print('FizzBuzz')\n        elif i % 3 == 0:\n"
                 "            print('Fizz')\n        elif i % 5 == 0:\n            print('Buzz')\n"
                 "        else:\n            print(i)\n")
# A code edit, which SmolLM2 answers by copying the function (with 8-bit activations it answers
# REPEAT_PROMPT with the function's name alone).
EDIT_PROMPT = "Add type hints to this function:\n\n" + REPEAT_PROMPT.split("\n\n", 1)[1]
CHAT = ["What is the capital of France?", "Write a haiku about the sea.",
        "def add(a, b):\n    return a + b\n\nWrite a docstring for this function."]
CHAT_MORE = ["Explain what a linked list is in two sentences.",
             "Give me three tips for writing clean Python code.",
             "Rename the function to `total` and add type hints:\n\ndef add(a, b):\n"
             "    return a + b\n",
             "List the planets of the solar system in order."]


@pytest.fixture(scope="module")
def smol_a8():
    from specserve import LLM

    return LLM(device="cpu", max_model_len=2048, quantization="gguf_a8")


def _chat(llm, texts):
    return [llm.apply_chat_template([{"role": "user", "content": t}]) for t in texts]


@pytest.mark.slow
def test_smollm2_a8_runs_every_projection_through_the_packed_blocks(smol_a8):
    from specserve.model.layers.quantization.gguf_blocks import GGUFBlockLinear

    model = smol_a8.llm_engine.runner.model
    blocks = [m for m in model.modules() if isinstance(m, GGUFBlockLinear)]
    assert len(blocks) == 30 * 4 + 1  # qkv, o, gate_up, down per layer, and the head
    assert {m.format_name for m in blocks} == {"Q4_1+a8", "Q8_0+a8"}
    assert all(m.blocks.dim() == 3 for m in blocks)  # repacked, not the file's rows


@pytest.mark.slow
@pytest.mark.parametrize("method", ["[ngram]", "[suffix]"])
def test_smollm2_a8_speculation_equals_plain(smol_a8, method):
    """Speculation over the 8-bit-activation model is exactly lossless, in a batch whose
    prompts the scheduler cuts into other chunks when speculating (its lookahead slots take
    token budget) and after the prompts were cached. Rounding to 8 bits turns a last-bit
    difference upstream into a visible one, so this needs every row computed alike in every
    step: the projections (test_a8_linear_bits_depend_only_on_the_row) and attention
    (test_run_attention_row_bits_do_not_depend_on_the_run). With attention of prompt chunks
    left to SDPA, half of 32 code-edit answers changed at batch 32."""
    from specserve import LLM, SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=64)
    prompts = _chat(smol_a8, [EDIT_PROMPT, *CHAT, *CHAT_MORE])
    plain = [o.outputs[0].token_ids for o in smol_a8.generate(prompts, params, use_tqdm=False)]
    cached = [o.outputs[0].token_ids for o in smol_a8.generate(prompts, params, use_tqdm=False)]
    assert cached == plain  # the second time the prompts come from the prefix cache
    # Not adaptive: every sequence with a match verifies its proposals, so how much is verified
    # does not depend on this machine's step timings (adaptive, a full-suite run on a loaded
    # 2-core VM verified 45 proposals and accepted 14, where a quiet one accepts > 20).
    spec = LLM(device="cpu", max_model_len=2048, quantization="gguf_a8",
               speculative_model=method, num_speculative_tokens=5, max_num_batched_tokens=96,
               speculative_adaptive=False,
               **({"ngram_prompt_lookup_max": 4} if method == "[ngram]" else {}))
    outs = spec.generate(prompts, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == plain
    metrics = spec.llm_engine.speculation.metrics.total
    assert metrics.num_accepted_tokens > 20  # the code edit was sped up, not just decoded


@pytest.mark.slow
def test_smollm2_a8_stays_as_close_to_float32_as_llama_cpp_does(smol_a8):
    """Rounding activations to 8 bits moves the model a little: over ~300 tokens of teacher-forced
    text the top token agrees with the float32 model's almost everywhere and the log-probability
    of the text barely moves. (benchmarks/gguf_a8_fidelity.py measured llama.cpp on the same file
    at the same distance: 95 % agreement on code and prose, mean |d logprob| 0.067.)"""
    from specserve import LLM, SamplingParams

    text = REPEAT_PROMPT + "\n".join(CHAT) + " The quick brown fox jumps over the lazy dog. " * 8
    params = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=1)
    fp32 = LLM(device="cpu", max_model_len=2048).generate([text], params, use_tqdm=False)[0]
    a8 = smol_a8.generate([text], params, use_tqdm=False)[0]
    ids = fp32.prompt_token_ids
    assert a8.prompt_token_ids == ids and len(ids) > 200

    def top(entry):
        return max(entry.items(), key=lambda kv: kv[1].logprob)[0]

    positions = range(1, len(ids))
    agree = sum(top(fp32.prompt_logprobs[t]) == top(a8.prompt_logprobs[t]) for t in positions)
    drift = [abs(fp32.prompt_logprobs[t][ids[t]].logprob - a8.prompt_logprobs[t][ids[t]].logprob)
             for t in positions]
    assert agree / len(positions) > 0.9
    assert sum(drift) / len(drift) < 0.15
    assert max(drift) > 0  # it is not silently the float32 model


def test_portable_path_gives_the_vnni_bits(tmp_path):
    """CPUs without AVX-512 VNNI compile the kernel's portable path (the same operations in the
    same order, one output at a time). Built here with VNNI switched off, it must give exactly
    the loaded kernel's bits, so a model's tokens do not depend on the CPU's instruction set.
    (On a CPU without VNNI both builds are the portable path and this checks less.)"""
    from torch.utils.cpp_extension import load

    csrc = cpu_kernels._CSRC
    binding = tmp_path / "bind.cpp"
    binding.write_text('#include "cpu_kernels.h"\n'
                       "PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {\n"
                       '  m.def("q4_1_a8_linear", &q4_1_a8_linear);\n'
                       '  m.def("q8_0_a8_linear", &q8_0_a8_linear);\n}\n')
    portable = load(name="specserve_a8_portable_test", sources=[str(binding),
                                                               str(csrc / "gguf_a8_linear.cpp")],
                    extra_include_paths=[str(csrc)], build_directory=str(tmp_path),
                    extra_cflags=["-O2", "-march=native", "-mno-avx512vnni", "-fopenmp"],
                    extra_ldflags=["-fopenmp"])
    gen = torch.Generator().manual_seed(9)
    for qtype, fmt in FORMATS:
        raw, _ = gguf_blocks(qtype, 131, 192, seed=3)
        packed = PACKERS[fmt](raw)
        x = torch.randn(9, 192, generator=gen) * torch.logspace(-3, 2, 9)[:, None]
        x[1, :32] = 0.0
        name = f"{fmt.lower()}_a8_linear"
        assert torch.equal(getattr(portable, name)(x, packed, 131),
                           getattr(kernels, name)(x, packed, 131)), fmt
