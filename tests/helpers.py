"""Shared test helpers: reference generation with transformers, engine construction."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import torch
from gguf import GGMLQuantizationType
from gguf.quants import dequantize, quantize
from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

from specserve import LLM


def gguf_blocks(qtype: GGMLQuantizationType, out_features: int, in_features: int,
                seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Random weights quantized by gguf: (raw blocks [N, K / 32 * block bytes] uint8, the
    dequantized [N, K] float32 values the loader would build)."""
    rng = np.random.default_rng(seed)
    w = rng.standard_normal((out_features, in_features)).astype(np.float32) * 0.05
    raw = quantize(w, qtype)
    dense = dequantize(raw, qtype)
    return torch.from_numpy(np.ascontiguousarray(raw)), torch.from_numpy(dense.astype(np.float32))


NEAR_TIE_N, NEAR_TIE_K = 256, 96  # near_tie_head: 16 groups of 16 columns, 3 blocks of 32 inputs


def near_tie_head(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A Q8_0 head for the greedy screens' tests (tests/test_greedy_screen*.py): blocks
    [N, K / 32 * 34] whose rows are one row of codes with a few codes moved by one (exact
    logits d * (x_a + x_b - x_c - x_e) apart), row 5 with x_0's code raised by 20 and row 40 a
    copy of it; and the dense weights."""
    n, k = NEAR_TIE_N, NEAR_TIE_K
    rng = np.random.default_rng(seed)
    base = rng.integers(-100, 101, size=k)
    codes = np.tile(base, (n, 1))
    for row in range(n):  # two codes up by one, two down: sum(codes) stays, logits barely move
        at = rng.choice(np.arange(1, k), size=4, replace=False)
        codes[row, at] += np.array([1, 1, -1, -1])
    codes[5, 0] = base[0] + 20  # a clear winner for x with a large x_0 ...
    codes[40] = codes[5]  # ... tied exactly with a later column
    d = np.float16(0.0123)
    raw = np.zeros((n, k // 32, 34), dtype=np.uint8)
    raw[:, :, :2] = np.frombuffer(d.tobytes(), dtype=np.uint8)
    raw[:, :, 2:] = codes.reshape(n, k // 32, 32).astype(np.int8).view(np.uint8)
    dense = torch.from_numpy((codes * np.float32(d)).astype(np.float32))
    return torch.from_numpy(raw.reshape(n, -1)), dense


def hf_model(path: Path, **kwargs):
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, **kwargs).eval()


def hf_greedy(model, prompt_ids: list[int], max_new_tokens: int,
              stop_at_eos: bool = False) -> list[int]:
    """transformers' greedy continuation of one unpadded prompt (the oracle)."""
    eos = model.generation_config.eos_token_id
    if not stop_at_eos:
        model.generation_config.eos_token_id = None  # generate() would fall back to it
    cfg = GenerationConfig(max_new_tokens=max_new_tokens, do_sample=False,
                           eos_token_id=eos if stop_at_eos else None, pad_token_id=0)
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt_ids]), generation_config=cfg,
                             attention_mask=torch.ones(1, len(prompt_ids), dtype=torch.long))
    return out[0, len(prompt_ids):].tolist()


def tokenizer(path: Path):
    return AutoTokenizer.from_pretrained(path)


def cpu_runner(path: Path, block_size: int, num_blocks: int):
    """A float32 CPU ModelRunner over a checkpoint, with its KV cache allocated."""
    from specserve.model.loader import iter_weights, load_hf_config, resolve_model
    from specserve.model.registry import build_model
    from specserve.worker.model_runner import ModelRunner

    source = resolve_model(str(path))
    model = build_model(load_hf_config(source), iter_weights(source), torch.float32,
                        torch.device("cpu"))
    runner = ModelRunner(model, torch.device("cpu"), torch.float32, block_size)
    runner.init_kv_cache(num_blocks)
    return runner


def tiny_llm(path: Path, **kwargs) -> LLM:
    kwargs.setdefault("device", "cpu")
    return LLM(model=str(path), **kwargs)


@contextlib.contextmanager
def returned_something(owner, name: str) -> Iterator[list[bool]]:
    """While the block runs, owner.name is wrapped: the list yielded gets, for every call,
    whether it returned something other than None or False (was a launch ahead taken or
    dropped?)."""
    original = getattr(owner, name)
    calls: list[bool] = []

    def spy(*args, **kwargs):
        out = original(*args, **kwargs)
        calls.append(out is not None and out is not False)
        return out

    setattr(owner, name, spy)
    try:
        yield calls
    finally:
        setattr(owner, name, original)
