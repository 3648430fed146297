"""Llama family (Llama 2/3/3.1, SmolLM2, Mistral-style GQA) reading Hugging Face weight names.

Qwen2 is the same network with biases on q/k/v, so it lives here as a subclass.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from transformers import PretrainedConfig

from specserve.model import lean_forward
from specserve.model.base import CausalLM, KVGeometry
from specserve.model.layers import cpu_kernels, fused_mlp, triton_ops
from specserve.model.layers.attention import Attention, AttentionMetadata
from specserve.model.layers.norm import RMSNorm
from specserve.model.layers.quantization.gguf_blocks import GGUFBlockLinear
from specserve.model.layers.rotary import RotaryEmbedding, RotaryTable, rope_settings
from specserve.model.weights import fused_linear


def _head_dim(config: PretrainedConfig) -> int:
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


class LlamaAttentionBlock(nn.Module):
    def __init__(self, config: PretrainedConfig, qkv_bias: bool) -> None:
        super().__init__()
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = getattr(config, "num_key_value_heads", None) or self.num_heads
        self.head_dim = _head_dim(config)
        q_size, kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        self.q_size, self.kv_size = q_size, kv_size
        self.qkv_proj = fused_linear(config.hidden_size, [q_size, kv_size, kv_size], bias=qkv_bias)
        self.o_proj = nn.Linear(q_size, config.hidden_size,
                                bias=getattr(config, "attention_bias", False) and not qkv_bias)
        base, scaling = rope_settings(config)
        self.rotary_emb = RotaryEmbedding(self.head_dim, config.max_position_embeddings, base,
                                          scaling)
        self.attn = Attention(self.num_heads, self.head_dim, self.num_kv_heads,
                              scale=self.head_dim**-0.5)

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor, meta: AttentionMetadata,
                rope: RotaryTable | None = None) -> torch.Tensor:
        """hidden [T, hidden] -> [T, hidden]. `rope` is the step's rotary table (looked up once
        by LlamaModel for all layers); computed here when the layer is called alone."""
        if rope is None:
            rope = self.rotary_emb.table(positions)
        qkv = triton_ops.linear(self.qkv_proj, hidden)  # [T, q + 2*kv]
        # Rotation and the K/V cache write are the backend's (fused into one kernel on CUDA).
        attn = self.attn.forward_packed(qkv, self.rotary_emb, rope, meta)  # [T, q]
        return triton_ops.linear(self.o_proj, attn)


class LlamaMLP(nn.Module):
    def __init__(self, config: PretrainedConfig) -> None:
        super().__init__()
        inter = config.intermediate_size
        self.gate_up_proj = fused_linear(config.hidden_size, [inter, inter], bias=False)
        self.down_proj = nn.Linear(inter, config.hidden_size, bias=False)
        self.intermediate_size = inter
        act = getattr(config, "hidden_act", "silu")
        if act != "silu":
            raise ValueError(f"hidden_act={act!r} is not supported for Llama models (only 'silu').")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        act = fused_mlp.silu_mul_of_linear(self.gate_up_proj, x)  # [T, I] or None
        if act is not None:  # a few CUDA rows: silu_mul in the gate_up GEMV (2 kernels, not 3)
            return triton_ops.linear(self.down_proj, act)
        gate_up = triton_ops.linear(self.gate_up_proj, x)  # [T, 2I]
        if triton_ops.available(gate_up):  # one kernel instead of 2
            return triton_ops.linear(self.down_proj, triton_ops.silu_mul(gate_up))
        if gate_up.dim() == 2 and cpu_kernels.available(gate_up):  # one C++ pass, not 2 ops
            return self.down_proj(cpu_kernels.load().silu_mul(gate_up))
        gate, up = gate_up.split(self.intermediate_size, dim=-1)  # [T, I] each
        return self.down_proj(F.silu(gate) * up)


class LlamaDecoderLayer(nn.Module):
    def __init__(self, config: PretrainedConfig, qkv_bias: bool) -> None:
        super().__init__()
        self.self_attn = LlamaAttentionBlock(config, qkv_bias)
        self.mlp = LlamaMLP(config)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor,
                residual: torch.Tensor | None, meta: AttentionMetadata,
                rope: RotaryTable | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """hidden [T, hidden]: the previous layer's MLP output, not yet added to `residual`
        [T, hidden], the residual stream (None at the first layer, whose input is the
        embedding). Returns (this layer's MLP output, the residual stream before it).

        Why the split: each residual add is done by the norm that follows it, one fused
        kernel on CUDA (RMSNorm.add_and_norm); the sums are the same as h + f(norm(h))."""
        if residual is None:
            residual, normed = hidden, self.input_layernorm(hidden)
        else:
            normed, residual = self.input_layernorm.add_and_norm(hidden, residual)
        attn = self.self_attn(positions, normed, meta, rope)  # [T, hidden]
        normed, residual = self.post_attention_layernorm.add_and_norm(attn, residual)
        return self.mlp(normed), residual


class LlamaModel(nn.Module):
    def __init__(self, config: PretrainedConfig, qkv_bias: bool) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(
            LlamaDecoderLayer(config, qkv_bias) for _ in range(config.num_hidden_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self._lean: lean_forward.LeanLlamaStack | None | bool = False  # False: not built yet

    def forward(self, input_ids, positions, meta) -> torch.Tensor:
        if input_ids.device.type == "cpu" and lean_forward.ENABLED:
            # Float32 on the CPU: the same ops as below without the module tree's Python
            # overhead (~2 ms of a ~9 ms SmolLM2 decode pass; see lean_forward.py). Planned on
            # the first CPU pass, after loading and quantization have settled the modules.
            if self._lean is False:
                self._lean = lean_forward.LeanLlamaStack.build(self)
            if self._lean is not None:
                return self._lean.forward(input_ids, positions, meta)
        hidden = self.embed_tokens(input_ids)  # [T, hidden]
        # Every layer has the same rotary table; look the step's positions up once.
        rope = self.layers[0].self_attn.rotary_emb.table(positions)
        residual = None
        for layer in self.layers:
            hidden, residual = layer(positions, hidden, residual, meta, rope)
        if residual is None:  # no layers
            return self.norm(hidden)
        return self.norm.add_and_norm(hidden, residual)[0]


class LlamaForCausalLM(CausalLM):
    packed_modules = {"qkv_proj": ["q_proj", "k_proj", "v_proj"],
                      "gate_up_proj": ["gate_proj", "up_proj"]}
    qkv_bias = False

    def __init__(self, config: PretrainedConfig) -> None:
        super().__init__(config)
        self.model = LlamaModel(config, self.qkv_bias)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        if getattr(config, "tie_word_embeddings", False):
            self.lm_head.weight = self.model.embed_tokens.weight

    def forward(self, input_ids, positions, meta) -> torch.Tensor:
        return self.model(input_ids, positions, meta)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return triton_ops.linear(self.lm_head, hidden)

    def greedy_tokens(self, hidden: torch.Tensor) -> torch.Tensor:
        if isinstance(self.lm_head, GGUFBlockLinear):  # its greedy screen, where it has one
            return self.lm_head.greedy_tokens(hidden)
        return super().greedy_tokens(hidden)

    def kv_geometry(self) -> KVGeometry:
        block = self.model.layers[0].self_attn
        return KVGeometry(len(self.model.layers), block.num_kv_heads, block.head_dim)


class Qwen2ForCausalLM(LlamaForCausalLM):
    qkv_bias = True
