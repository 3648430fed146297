"""The Llama decoder stack as one flat loop, for eager float32 passes on the CPU.

Why: a CPU decode pass of SmolLM2 (30 layers) spent about 2 ms of its ~9 in Python around
the kernels: ~7 ``nn.Module.__call__`` per layer, ``Module.__getattr__`` for every submodule and
parameter, and the device/dtype checks each layer repeats to pick between its CUDA, CPU-kernel
and torch paths. Those choices do not change within a model, so they are made once, here, when
the plan is built: each layer becomes a tuple of the tensors and bound functions its pass calls,
and the loop calls them with nothing in between. The attention backend does the same for its
part of each step (``AttentionBackend.layer_pass``: the CPU kernels' rotary + KV write and
attention, their checks made once per step). On the 2-core CI machine (session 21): 1-row pass
8.74 -> 6.74 ms, 6-row verification pass 16.68 -> 14.58 ms, engine decode at batch 1 1.28x.

The module tree stays the definition of the model and serves every other device and dtype. This
plan runs the very same ops in the same order on the same tensors (the CPU kernels of
layers/csrc for the norms, the MLP's silu * up and the GGUF projections, ``F.linear`` for dense
ones, the attention backend's kernels or the layer's own ``forward_packed``), so its outputs
are bit-identical to the modules' (checked by tests/test_lean_forward.py on dense and GGUF
checkpoints, prefill, decode and verification).

A model gets a plan only when every piece is one whose CPU path is known here: float32
weights, the CPU kernels loaded, ``RMSNorm`` norms, and projections that are plain
``nn.Linear`` or ``GGUFBlockLinear``. Anything else (a quantized int4/int8 module, a model on
CUDA, ``SPECSERVE_CPU_KERNELS=0``) keeps the module path. The plan is built on the model's first
CPU pass and holds its modules' tensors from then on: code that replaces a layer's modules after
that must reset ``LlamaModel._lean`` to False (it is rebuilt on the next pass).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from specserve.model.layers import cpu_kernels
from specserve.model.layers.attention import Attention, AttentionMetadata
from specserve.model.layers.norm import RMSNorm
from specserve.model.layers.quantization.gguf_blocks import GGUFBlockLinear
from specserve.model.layers.rotary import RotaryEmbedding

#: Module-level switch (A/B timing, tests): off = every model runs its module tree.
ENABLED = True

Projection = Callable[[torch.Tensor], torch.Tensor]  # x [T, K] -> [T, N]


class LeanLayer(NamedTuple):
    """What one decoder layer's pass touches, resolved once."""

    input_norm: torch.Tensor  # [hidden] float32
    input_eps: float
    post_norm: torch.Tensor  # [hidden] float32
    post_eps: float
    qkv: Projection
    o: Projection
    gate_up: Projection
    down: Projection
    attention: Attention
    rotary: RotaryEmbedding


def _projection(module: nn.Module) -> Projection | None:
    """x -> module(x) for a 2-D float32 x, as the module's own forward computes it."""
    if (isinstance(module, nn.Linear) and type(module).forward is nn.Linear.forward
            and module.weight.dtype == torch.float32):  # nn.Linear, PackedLinear
        weight, bias = module.weight, module.bias
        return lambda x: F.linear(x, weight, bias)
    if type(module) is GGUFBlockLinear:
        kernel, blocks, bias = module._kernel, module.blocks, module.bias
        if bias is None:
            return lambda x: kernel(x, blocks)
        return lambda x: kernel(x, blocks) + bias
    return None


def _float32_norm(norm: nn.Module) -> bool:
    return type(norm) is RMSNorm and norm.weight.dtype == torch.float32


class LeanLlamaStack:
    """``LlamaModel.forward`` for a float32 model on the CPU, without the module tree."""

    def __init__(self, embedding: torch.Tensor, layers: list[LeanLayer], final_norm: RMSNorm,
                 kernels) -> None:
        self.embedding = embedding  # [vocab, hidden]
        self.layers = layers
        self.final_norm, self.final_eps = final_norm.weight, final_norm.eps
        self.kernels = kernels

    @classmethod
    def build(cls, model: nn.Module) -> LeanLlamaStack | None:
        """The plan for a LlamaModel, or None when some part of it is not covered."""
        kernels = cpu_kernels.load()
        embedding = model.embed_tokens.weight
        if (kernels is None or embedding.device.type != "cpu" or embedding.dtype != torch.float32
                or not model.layers or not _float32_norm(model.norm)):
            return None
        layers = []
        for layer in model.layers:
            block, mlp = layer.self_attn, layer.mlp
            projections = [_projection(m) for m in (block.qkv_proj, block.o_proj,
                                                    mlp.gate_up_proj, mlp.down_proj)]
            if (None in projections or not _float32_norm(layer.input_layernorm)
                    or not _float32_norm(layer.post_attention_layernorm)):
                return None
            layers.append(LeanLayer(layer.input_layernorm.weight, layer.input_layernorm.eps,
                                    layer.post_attention_layernorm.weight,
                                    layer.post_attention_layernorm.eps, *projections,
                                    block.attn, block.rotary_emb))
        return cls(embedding, layers, model.norm, kernels)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                meta: AttentionMetadata) -> torch.Tensor:
        """input_ids, positions [T] -> final hidden states [T, hidden]: LlamaModel.forward's
        ops, in its order (see LlamaDecoderLayer.forward for why each residual add happens
        inside the norm after it)."""
        kernels = self.kernels
        hidden = F.embedding(input_ids, self.embedding)  # [T, hidden]
        first = self.layers[0]
        rope = first.rotary.table(positions)  # one table for every layer
        # The backend's per-step attention, when it has one (the CPU kernels' decode and
        # verification steps); else each layer's forward_packed.
        attend = first.attention.backend.layer_pass(meta, first.rotary, rope)
        residual = None
        for layer in self.layers:
            if residual is None:
                residual, normed = hidden, kernels.rms_norm(hidden, layer.input_norm,
                                                            layer.input_eps)
            else:
                normed, residual = kernels.add_rms_norm(hidden, residual, layer.input_norm,
                                                        layer.input_eps)
            qkv = layer.qkv(normed)  # [T, q + 2 kv]
            if attend is not None:
                attn = attend(qkv, layer.attention)  # [T, q]
            else:
                attn = layer.attention.forward_packed(qkv, layer.rotary, rope, meta)
            normed, residual = kernels.add_rms_norm(layer.o(attn), residual, layer.post_norm,
                                                    layer.post_eps)
            hidden = layer.down(kernels.silu_mul(layer.gate_up(normed)))  # [T, 2I] -> [T, I]
        return kernels.add_rms_norm(hidden, residual, self.final_norm, self.final_eps)[0]
