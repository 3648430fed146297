"""The flat CPU forward (model/lean_forward.py) against the module tree it stands in for.

It must run exactly the modules' ops: same logits bit for bit on prefill, decode and
verification passes, for dense checkpoints (with and without qkv bias) and for SmolLM2's GGUF
blocks; and it must stand aside for anything it does not cover."""

from __future__ import annotations

import pytest
import torch
from helpers import cpu_runner

from specserve.model import lean_forward
from specserve.model.layers.attention.torch_backend import TorchAttentionBackend
from specserve.model.lean_forward import LeanLlamaStack
from specserve.worker.loading import load_model
from specserve.worker.model_runner import ModelRunner, SequenceRun

BLOCK = 16
PROMPT = [(11 * i + 5) % 60 + 3 for i in range(21)]


def _steps(prompt: list[int]) -> list[list[SequenceRun]]:
    """A prefill of two prompts, a decode step of both, then a verification step (a 5-token
    run beside a 1-token one), as the engine would schedule them."""
    n = len(prompt)
    other = prompt[::-1][: n - 3]
    a_blocks, b_blocks = list(range(1, 5)), list(range(5, 9))
    return [
        [SequenceRun(prompt, 0, a_blocks, [n - 1]), SequenceRun(other, 0, b_blocks, [len(other) - 1])],
        [SequenceRun([7], n, a_blocks, [0]), SequenceRun([9], len(other), b_blocks, [0])],
        [SequenceRun([3, 1, 4, 1, 5], n + 1, a_blocks, [0, 1, 2, 3, 4]),
         SequenceRun([2], len(other) + 1, b_blocks, [0])],
    ]


def _logits(make_runner, enabled: bool, monkeypatch) -> list[torch.Tensor]:
    monkeypatch.setattr(lean_forward, "ENABLED", enabled)
    runner = make_runner()
    return [runner.execute(runs) for runs in _steps(PROMPT)]


def _same_both_ways(make_runner, monkeypatch) -> None:
    passes = []  # per step: did the backend's one-pass attention serve the layers?
    real = TorchAttentionBackend.layer_pass
    monkeypatch.setattr(TorchAttentionBackend, "layer_pass",
                        lambda self, *a: passes.append(real(self, *a)) or passes[-1])
    lean = _logits(make_runner, True, monkeypatch)
    # prefill, decode and verification each in one pass (the C++ attention serves every step)
    assert [p is not None for p in passes] == [True, True, True]
    modules = _logits(make_runner, False, monkeypatch)
    for step, (a, b) in enumerate(zip(lean, modules, strict=True)):
        assert torch.equal(a, b), f"step {step}: the lean forward's logits differ"


@pytest.mark.parametrize("name", ["tiny_llama", "tiny_qwen2", "tiny_llama3_rope"])
def test_lean_forward_equals_the_modules_on_dense_checkpoints(name, request, monkeypatch):
    path = request.getfixturevalue(name)
    used = []
    real = LeanLlamaStack.forward
    monkeypatch.setattr(LeanLlamaStack, "forward",
                        lambda self, *a: used.append(1) or real(self, *a))
    _same_both_ways(lambda: cpu_runner(path, BLOCK, 16), monkeypatch)
    assert len(used) == 3, "the lean forward did not serve the passes"


@pytest.mark.slow
def test_lean_forward_equals_the_modules_on_smollm2_gguf_blocks(smollm2_gguf, monkeypatch):
    def make_runner():
        model = load_model(str(smollm2_gguf), torch.float32, torch.device("cpu")).model
        runner = ModelRunner(model, torch.device("cpu"), torch.float32, BLOCK)
        runner.init_kv_cache(16)
        return runner

    _same_both_ways(make_runner, monkeypatch)


def test_lean_forward_stands_aside_for_what_it_does_not_cover(tiny_llama, monkeypatch):
    runner = cpu_runner(tiny_llama, BLOCK, 16)
    model = runner.model.model
    prefill = _steps(PROMPT)[0]
    before = runner.execute(prefill)
    assert isinstance(model._lean, LeanLlamaStack)  # planned on the first CPU pass
    model.layers[0].mlp.down_proj = torch.nn.Sequential(model.layers[0].mlp.down_proj)
    assert LeanLlamaStack.build(model) is None  # a projection it does not know
    model._lean = False  # modules replaced after the plan: planned again on the next pass
    assert torch.equal(runner.execute(prefill), before) and model._lean is None
    monkeypatch.setattr("specserve.model.layers.cpu_kernels.load", lambda: None)
    assert LeanLlamaStack.build(cpu_runner(tiny_llama, BLOCK, 16).model.model) is None
