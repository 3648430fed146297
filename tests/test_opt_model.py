"""OPT through the paged runner matches Hugging Face's OPT logits (chunked prefill, batching,
decode), for both the common pre-LN layout and opt-350m's post-LN + projected embeddings."""

from __future__ import annotations

import pytest
import torch
from transformers import OPTConfig
from transformers import OPTForCausalLM as HFOPT

from specserve.model.opt import OPTForCausalLM
from specserve.model.registry import build_model
from specserve.worker.model_runner import ModelRunner, SequenceRun

VOCAB = 320
BLOCK = 16
TOL = 1e-4
PROMPT0, PROMPT1, DECODE_STEPS = 40, 30, 3


def _hf_opt(**overrides) -> HFOPT:
    torch.manual_seed(0)
    cfg = OPTConfig(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2,
                    num_attention_heads=4, ffn_dim=128, max_position_embeddings=512,
                    word_embed_proj_dim=overrides.pop("word_embed_proj_dim", 64),
                    init_std=0.2, **overrides)
    cfg.architectures = ["OPTForCausalLM"]
    return HFOPT(cfg).eval()


def _runner(hf: HFOPT, weights) -> ModelRunner:
    model = build_model(hf.config, weights, torch.float32, torch.device("cpu"))
    assert isinstance(model, OPTForCausalLM)
    runner = ModelRunner(model, torch.device("cpu"), torch.float32, block_size=BLOCK)
    runner.init_kv_cache(64)
    return runner


def _close(ours: torch.Tensor, ref: torch.Tensor) -> None:
    assert ours.shape == ref.shape
    assert (ours - ref).abs().max().item() < TOL


CASES = {
    "pre_ln": {},
    "gelu": {"activation_function": "gelu"},
    "opt350m_like": {"word_embed_proj_dim": 32, "do_layer_norm_before": False},
}


@pytest.mark.parametrize("overrides", CASES.values(), ids=CASES.keys())
def test_opt_matches_hf(overrides: dict) -> None:
    hf = _hf_opt(**overrides)
    runner = _runner(hf, hf.state_dict().items())
    gen = torch.Generator().manual_seed(1)
    seq0 = torch.randint(0, VOCAB, (PROMPT0 + DECODE_STEPS,), generator=gen)
    seq1 = torch.randint(0, VOCAB, (PROMPT1 + DECODE_STEPS,), generator=gen)
    with torch.no_grad():
        ref0 = hf(seq0[None]).logits[0]  # [T0, vocab]
        ref1 = hf(seq1[None]).logits[0]
    table0, table1 = [0, 1, 2], [5, 6, 7]

    # seq0's first prefill chunk batched with seq1's whole prompt
    out = runner.execute([
        SequenceRun(seq0[:25].tolist(), 0, table0[:2], list(range(25))),
        SequenceRun(seq1[:PROMPT1].tolist(), 0, table1[:2], list(range(PROMPT1))),
    ])
    _close(out[:25], ref0[:25])
    _close(out[25:], ref1[:PROMPT1])

    # seq0's second chunk (crosses into a third block) attends to the cached first chunk
    out = runner.execute([SequenceRun(seq0[25:PROMPT0].tolist(), 25, table0,
                                      list(range(PROMPT0 - 25)))])
    _close(out, ref0[25:PROMPT0])

    # single-token decode steps for both sequences together
    for step in range(DECODE_STEPS):
        p0, p1 = PROMPT0 + step, PROMPT1 + step
        out = runner.execute([
            SequenceRun([int(seq0[p0])], p0, table0, [0]),
            SequenceRun([int(seq1[p1])], p1, table1, [0]),
        ])
        _close(out[0], ref0[p0])
        _close(out[1], ref1[p1])


def test_opt_original_names_without_lm_head() -> None:
    """facebook/opt-* files name tensors `decoder.*` and omit the tied lm_head."""
    hf = _hf_opt()
    weights = [(name.removeprefix("model."), t) for name, t in hf.state_dict().items()
               if name != "lm_head.weight"]
    runner = _runner(hf, weights)
    model = runner.model
    assert model.lm_head.weight is model.get_input_embeddings().weight
    assert model.kv_geometry().num_kv_heads == 4 and model.kv_geometry().head_dim == 16
    ids = torch.randint(0, VOCAB, (20,), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        ref = hf(ids[None]).logits[0]
    out = runner.execute([SequenceRun(ids.tolist(), 0, [0, 1], list(range(20)))])
    _close(out, ref)


def test_opt_rejects_unknown_activation() -> None:
    cfg = _hf_opt().config
    cfg.activation_function = "swish_beta"
    with pytest.raises(ValueError, match="activation_function"):
        OPTForCausalLM(cfg)
