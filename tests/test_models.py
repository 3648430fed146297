"""Our architectures against transformers on the same tiny random checkpoints (fp32)."""

from __future__ import annotations

import pytest
import torch
from helpers import cpu_runner, hf_model

from specserve.worker.model_runner import ModelRunner, SequenceRun

BLOCK = 16
ARCH_FIXTURES = ["tiny_llama", "tiny_opt", "tiny_qwen2", "tiny_llama3_rope"]


def _runner(path) -> ModelRunner:
    return cpu_runner(path, BLOCK, 64)


@pytest.mark.parametrize("fixture", ARCH_FIXTURES)
def test_logits_match_transformers_across_blocks(fixture, request):
    path = request.getfixturevalue(fixture)
    runner = _runner(path)
    hf = hf_model(path)
    gen = torch.Generator().manual_seed(0)
    vocab = hf.config.vocab_size
    long_ids = torch.randint(0, vocab, (1, 90), generator=gen)  # spans 6 blocks
    short_ids = torch.randint(0, vocab, (1, 21), generator=gen)
    with torch.no_grad():
        ref_long = hf(long_ids).logits[0]  # [90, vocab]
        ref_short = hf(short_ids).logits[0]
    long_blocks, short_blocks = [3, 9, 4, 20, 7, 11], [30, 31]
    # Step 1: first chunk of the long prompt batched with the whole short prompt.
    out = runner.execute([
        SequenceRun(long_ids[0, :40].tolist(), 0, long_blocks[:3], list(range(40))),
        SequenceRun(short_ids[0].tolist(), 0, short_blocks, list(range(21))),
    ])
    assert (out[:40] - ref_long[:40]).abs().max() < 1e-4
    assert (out[40:] - ref_short).abs().max() < 1e-4
    # Step 2: the rest of the long prompt (reads cached blocks written in step 1).
    out = runner.execute([SequenceRun(long_ids[0, 40:].tolist(), 40, long_blocks,
                                      list(range(50)))])
    assert (out - ref_long[40:]).abs().max() < 1e-4


@pytest.mark.parametrize("fixture", ["tiny_llama", "tiny_opt"])
def test_decode_steps_match_transformers(fixture, request):
    """Single-token decodes and a 4-token multi-query run over an existing context."""
    path = request.getfixturevalue(fixture)
    runner = _runner(path)
    hf = hf_model(path)
    ids = torch.randint(0, hf.config.vocab_size, (1, 37), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ref = hf(ids).logits[0]
    blocks = [5, 2, 8]
    runner.execute([SequenceRun(ids[0, :30].tolist(), 0, blocks, [29])])
    for pos in range(30, 33):
        out = runner.execute([SequenceRun([int(ids[0, pos])], pos, blocks, [0])])
        assert (out[0] - ref[pos]).abs().max() < 1e-4
    out = runner.execute([SequenceRun(ids[0, 33:37].tolist(), 33, blocks, [0, 1, 2, 3])])
    assert (out - ref[33:37]).abs().max() < 1e-4
