"""Float32 CPU linear weights are stored input-major (MKL's fast layout for multi-row matmuls):
the layout changes, the values and everything that reads them do not."""

from __future__ import annotations

import torch
from helpers import hf_model, tiny_llm
from torch import nn

from specserve.model.layers.weight_layout import store_linear_weights_input_major
from specserve.worker.model_runner import SequenceRun


def test_linear_weights_become_transposed_views_with_the_same_values():
    torch.manual_seed(0)
    embed = nn.Embedding(50, 8)
    head = nn.Linear(8, 50, bias=False)
    head.weight = embed.weight  # tied
    model = nn.ModuleList([embed, nn.Linear(8, 16), head, nn.Linear(16, 8).to(torch.bfloat16)])
    x = torch.randn(6, 8)
    before = [model[1](x), model[2](x), model[0](torch.tensor([3, 7]))]
    assert store_linear_weights_input_major(model) == 2  # the tied weight counts once
    for linear in (model[1], model[2]):
        assert linear.weight.shape == (linear.out_features, linear.in_features)
        assert linear.weight.t().is_contiguous() and not linear.weight.is_contiguous()
    assert model[2].weight is model[0].weight
    assert model[3].weight.is_contiguous()  # only float32 is re-stored (measured for it)
    after = [model[1](x), model[2](x), model[0](torch.tensor([3, 7]))]
    for a, b in zip(before, after, strict=True):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=0)


def test_engine_loads_cpu_weights_input_major_and_matches_transformers(tiny_qwen2):
    """tiny_qwen2 ties lm_head to the embeddings and has qkv biases: logits of a prompt
    spanning several blocks and rows (the multi-row path) equal transformers'."""
    llm = tiny_llm(tiny_qwen2, block_size=16)
    runner = llm.llm_engine.runner
    linears = [m for m in runner.model.modules() if isinstance(m, nn.Linear)]
    assert linears and all(m.weight.t().is_contiguous() for m in linears)
    ids = torch.randint(3, 200, (40,), generator=torch.Generator().manual_seed(0)).tolist()
    logits = runner.execute([SequenceRun(ids, 0, [1, 2, 3], list(range(40)))])  # [40, V]
    with torch.no_grad():
        expected = hf_model(tiny_qwen2)(torch.tensor([ids])).logits[0]
    torch.testing.assert_close(logits, expected, atol=1e-4, rtol=0)
