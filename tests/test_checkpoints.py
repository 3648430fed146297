"""The tiny test checkpoints load in transformers, are deterministic and greedy-stable."""

from __future__ import annotations

import json

import pytest
import torch
from checkpoints import (
    BOS_TOKEN_ID,
    EOS_TOKEN_ID,
    LLAMA3_ROPE_SCALING,
    PAD_TOKEN_ID,
    SPECIAL_TOKENS,
    TOKENIZER_VOCAB_SIZE,
    build_tiny_checkpoint,
    build_tokenizer,
    default_vocab_size,
)
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

CHECKPOINT_FIXTURES = ("tiny_llama", "tiny_llama_draft", "tiny_opt", "tiny_opt_draft",
                       "tiny_qwen2", "tiny_llama3_rope")
CHECKPOINT_FILES = ("config.json", "generation_config.json", "model.safetensors",
                    "special_tokens_map.json", "tokenizer.json", "tokenizer_config.json")
MARGIN_STEPS = 24
# Greedy comparisons need the top-1 / top-2 logit gap to dwarf float noise (~1e-5 in fp32).
MIN_MEDIAN_MARGIN = 0.3
TIE_MARGIN = 1e-3
MAX_TIE_FRACTION = 0.02


@pytest.fixture(params=CHECKPOINT_FIXTURES)
def checkpoint(request):
    return request.param, request.getfixturevalue(request.param)


def test_checkpoint_loads_in_transformers(checkpoint):
    name, path = checkpoint
    assert {p.name for p in path.iterdir()} >= set(CHECKPOINT_FILES)
    model = AutoModelForCausalLM.from_pretrained(path).eval()
    cfg = model.config
    assert cfg.vocab_size == default_vocab_size() == 448
    assert (cfg.bos_token_id, cfg.eos_token_id, cfg.pad_token_id) == (1, 2, 0)
    assert cfg.num_hidden_layers == (1 if name.endswith("_draft") else 2)
    assert cfg.hidden_size == 64 and cfg.num_attention_heads == 4
    assert cfg.max_position_embeddings == 512
    with torch.no_grad():
        logits = model(torch.tensor([[BOS_TOKEN_ID, 100, 200, 300]])).logits
    assert logits.shape == (1, 4, cfg.vocab_size) and torch.isfinite(logits).all()


def test_configs_use_hub_layout(tiny_llama, tiny_qwen2, tiny_opt, tiny_llama3_rope):
    llama = json.loads((tiny_llama / "config.json").read_text())
    assert llama["rope_theta"] == 10000.0 and llama["rope_scaling"] is None
    assert "rope_parameters" not in llama and llama["torch_dtype"] == "float32"
    assert llama["num_key_value_heads"] == 2 and llama["head_dim"] == 16
    assert llama["intermediate_size"] == 128 and not llama["tie_word_embeddings"]
    qwen2 = json.loads((tiny_qwen2 / "config.json").read_text())
    assert qwen2["rope_theta"] == 1e6 and qwen2["tie_word_embeddings"]
    opt = json.loads((tiny_opt / "config.json").read_text())
    assert opt["ffn_dim"] == 128 and opt["word_embed_proj_dim"] == 64
    assert opt["do_layer_norm_before"] and opt["tie_word_embeddings"]
    rope3 = json.loads((tiny_llama3_rope / "config.json").read_text())
    assert rope3["rope_scaling"] == LLAMA3_ROPE_SCALING
    loaded = AutoConfig.from_pretrained(tiny_llama3_rope).rope_parameters
    assert loaded["rope_type"] == "llama3" and loaded["factor"] == 8.0


def test_weights_have_no_trivial_parameters(tiny_qwen2, tiny_opt):
    """Biases and norm gains are random, so a loader that drops them is caught."""
    for path in (tiny_qwen2, tiny_opt):
        model = AutoModelForCausalLM.from_pretrained(path)
        for name, param in model.named_parameters():
            if param.dim() == 1:
                assert not torch.all(param == 0) and not torch.all(param == 1), name


def test_tokenizer_special_tokens_and_roundtrip(tiny_llama, test_prompts):
    tok = AutoTokenizer.from_pretrained(tiny_llama)
    assert len(tok) == TOKENIZER_VOCAB_SIZE
    assert [tok.convert_tokens_to_ids(t) for t in SPECIAL_TOKENS] == [0, 1, 2]
    assert (tok.bos_token_id, tok.eos_token_id, tok.pad_token_id) == (
        BOS_TOKEN_ID, EOS_TOKEN_ID, PAD_TOKEN_ID)
    texts = [*test_prompts, "", " ", "  leading and trailing  ", "a\n\n\tb", "x<|im_end|>y"]
    for text in texts:
        ids = tok.encode(text, add_special_tokens=True)
        assert tok.decode(ids) == text
    ids = tok.encode(test_prompts[-1])
    assert len(ids) < 0.6 * len(test_prompts[-1].encode())  # merges give multi-byte tokens
    assert BOS_TOKEN_ID not in ids  # no BOS is added automatically
    assert tok.encode("a<|im_end|>")[-1] == EOS_TOKEN_ID


def test_chat_template_renders(tiny_llama):
    tok = AutoTokenizer.from_pretrained(tiny_llama)
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi!"}]
    text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert text == ("<|im_start|>system\nBe brief.<|im_end|>\n"
                    "<|im_start|>user\nHi!<|im_end|>\n<|im_start|>assistant\n")
    text = tok.apply_chat_template(messages[1:], tokenize=False)
    assert text == "<|im_start|>user\nHi!<|im_end|>\n"


def test_drafts_share_the_tokenizer(tiny_llama, tiny_llama_draft, tiny_opt, tiny_qwen2):
    tokenizer_json = (tiny_llama / "tokenizer.json").read_bytes()
    for path in (tiny_llama_draft, tiny_opt, tiny_qwen2):
        assert (path / "tokenizer.json").read_bytes() == tokenizer_json


def test_builds_are_deterministic(tmp_path, tiny_llama):
    first = build_tiny_checkpoint(tmp_path / "a", "llama")
    for file_name in CHECKPOINT_FILES:  # tiny_llama was built with the same arguments
        assert (first / file_name).read_bytes() == (tiny_llama / file_name).read_bytes()
    other = build_tiny_checkpoint(tmp_path / "b", "llama", seed=5)
    assert (other / "model.safetensors").read_bytes() != (first / "model.safetensors").read_bytes()
    build_tokenizer(tmp_path / "tok")
    assert (tmp_path / "tok/tokenizer.json").read_bytes() == (first / "tokenizer.json").read_bytes()


def test_bf16_build(tmp_path):
    path = build_tiny_checkpoint(tmp_path / "bf16", "qwen2", dtype=torch.bfloat16, num_layers=1)
    assert json.loads((path / "config.json").read_text())["torch_dtype"] == "bfloat16"
    model = AutoModelForCausalLM.from_pretrained(path, dtype="auto")
    assert next(model.parameters()).dtype == torch.bfloat16


def test_llama3_rope_changes_only_positions(tiny_llama, tiny_llama3_rope):
    """Same weights; rope differs, so position 0 matches and later positions do not."""
    ids = torch.tensor([[1, 40, 80, 120, 160, 200, 240, 280, 320, 360] * 4])
    with torch.no_grad():
        plain = AutoModelForCausalLM.from_pretrained(tiny_llama)(ids).logits[0]
        scaled = AutoModelForCausalLM.from_pretrained(tiny_llama3_rope)(ids).logits[0]
    torch.testing.assert_close(plain[0], scaled[0])
    assert (plain[1:] - scaled[1:]).abs().amax() > 1e-2


def greedy_margins(path, prompts) -> torch.Tensor:
    """Top-1 minus top-2 logit at each greedy step (fp32); also checks fp64 picks the same."""
    tok = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path).eval()
    model64 = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float64).eval()
    margins = []
    for prompt in prompts:
        ids = torch.tensor([tok.encode(prompt)])  # [1, prompt_len]
        start = ids.shape[1] - 1
        with torch.no_grad():
            for _ in range(MARGIN_STEPS):  # no KV cache: tiny model, short sequences
                next_id = model(ids).logits[0, -1].argmax()
                ids = torch.cat([ids, next_id.view(1, 1)], dim=1)
            logits = model(ids).logits[0, start:-1]  # [MARGIN_STEPS, vocab]
            logits64 = model64(ids).logits[0, start:-1]
        assert torch.equal(logits.argmax(-1), ids[0, start + 1:])
        assert torch.equal(logits64.argmax(-1), ids[0, start + 1:])
        top2 = logits.topk(2, dim=-1).values
        margins.append(top2[:, 0] - top2[:, 1])
    return torch.cat(margins)


@pytest.mark.parametrize("name", ["tiny_llama", "tiny_opt", "tiny_qwen2", "tiny_llama3_rope"])
def test_greedy_logit_margins_are_wide(request, name, test_prompts):
    margins = greedy_margins(request.getfixturevalue(name), test_prompts[::2])
    ties = (margins < TIE_MARGIN).float().mean().item()
    assert margins.median() > MIN_MEDIAN_MARGIN, margins.median()
    assert ties <= MAX_TIE_FRACTION, (ties, margins.min())


def test_smollm2_gguf_is_found(smollm2_gguf):
    with open(smollm2_gguf, "rb") as f:
        assert f.read(4) == b"GGUF"
