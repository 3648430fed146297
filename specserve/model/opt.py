"""Meta's OPT family (opt-125m ... opt-66b) reading Hugging Face weight names.

Differences from Llama worth knowing: learned absolute position embeddings (looked up at
position + 2, a fairseq leftover), LayerNorm with biases, biased projections, a plain two-layer
ReLU MLP, no rotary. opt-350m is the odd one: post-LN layers and a 512-wide embedding projected
in and out of the 1024-wide decoder.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch
import torch.nn.functional as F
from torch import nn
from transformers import PretrainedConfig

from specserve.model.base import CausalLM, KVGeometry
from specserve.model.layers.attention import Attention, AttentionMetadata
from specserve.model.weights import fused_linear, load_into

# OPT's learned position table has two extra leading rows; position p reads row p + 2.
POSITION_OFFSET = 2

_ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "relu": F.relu,
    "gelu": F.gelu,
    "gelu_new": lambda x: F.gelu(x, approximate="tanh"),
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
}


def _activation(config: PretrainedConfig) -> Callable[[torch.Tensor], torch.Tensor]:
    name = getattr(config, "activation_function", "relu")
    if name not in _ACTIVATIONS:
        raise ValueError(f"activation_function={name!r} is not supported for OPT models; "
                         f"supported: {sorted(_ACTIVATIONS)}.")
    return _ACTIVATIONS[name]


def _layer_norm(config: PretrainedConfig) -> nn.LayerNorm:
    return nn.LayerNorm(config.hidden_size,
                        elementwise_affine=getattr(config, "layer_norm_elementwise_affine", True))


class OPTAttentionBlock(nn.Module):
    def __init__(self, config: PretrainedConfig) -> None:
        super().__init__()
        hidden = config.hidden_size
        self.num_heads = config.num_attention_heads
        self.head_dim = hidden // self.num_heads
        if self.head_dim * self.num_heads != hidden:
            raise ValueError(f"hidden_size={hidden} is not divisible by "
                             f"num_attention_heads={self.num_heads}.")
        bias = getattr(config, "enable_bias", True)
        self.qkv_proj = fused_linear(hidden, [hidden, hidden, hidden], bias=bias)
        self.out_proj = nn.Linear(hidden, hidden, bias=bias)
        # OPT has no grouped-query attention: kv heads == query heads.
        self.attn = Attention(self.num_heads, self.head_dim, self.num_heads,
                              scale=self.head_dim**-0.5)

    def forward(self, hidden: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        q, k, v = self.qkv_proj(hidden).chunk(3, dim=-1)  # [T, hidden] each
        return self.out_proj(self.attn(q, k, v, meta))


class OPTDecoderLayer(nn.Module):
    def __init__(self, config: PretrainedConfig) -> None:
        super().__init__()
        bias = getattr(config, "enable_bias", True)
        self.pre_norm = config.do_layer_norm_before
        self.self_attn = OPTAttentionBlock(config)
        self.self_attn_layer_norm = _layer_norm(config)
        self.fc1 = nn.Linear(config.hidden_size, config.ffn_dim, bias=bias)
        self.fc2 = nn.Linear(config.ffn_dim, config.hidden_size, bias=bias)
        self.final_layer_norm = _layer_norm(config)
        self.act = _activation(config)

    def _mlp(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.act(self.fc1(x)))  # [T, hidden]

    def forward(self, hidden: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        if self.pre_norm:
            hidden = hidden + self.self_attn(self.self_attn_layer_norm(hidden), meta)
            return hidden + self._mlp(self.final_layer_norm(hidden))
        # post-LN (opt-350m): normalise after each residual add
        hidden = self.self_attn_layer_norm(hidden + self.self_attn(hidden, meta))
        return self.final_layer_norm(hidden + self._mlp(hidden))


class OPTDecoder(nn.Module):
    def __init__(self, config: PretrainedConfig) -> None:
        super().__init__()
        hidden, embed_dim = config.hidden_size, config.word_embed_proj_dim
        self.embed_tokens = nn.Embedding(config.vocab_size, embed_dim)
        self.embed_positions = nn.Embedding(config.max_position_embeddings + POSITION_OFFSET,
                                            hidden)
        projected = embed_dim != hidden
        self.project_in = nn.Linear(embed_dim, hidden, bias=False) if projected else None
        self.project_out = nn.Linear(hidden, embed_dim, bias=False) if projected else None
        self.layers = nn.ModuleList(OPTDecoderLayer(config)
                                    for _ in range(config.num_hidden_layers))
        keep_final = config.do_layer_norm_before and not getattr(
            config, "_remove_final_layer_norm", False)
        self.final_layer_norm = _layer_norm(config) if keep_final else None

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                meta: AttentionMetadata) -> torch.Tensor:
        hidden = self.embed_tokens(input_ids)  # [T, word_embed_proj_dim]
        if self.project_in is not None:
            hidden = self.project_in(hidden)  # [T, hidden]
        hidden = hidden + self.embed_positions(positions + POSITION_OFFSET)
        for layer in self.layers:
            hidden = layer(hidden, meta)
        if self.final_layer_norm is not None:
            hidden = self.final_layer_norm(hidden)
        if self.project_out is not None:
            hidden = self.project_out(hidden)  # [T, word_embed_proj_dim]
        return hidden


class OPTModel(nn.Module):
    """Only here so parameter names match the checkpoint's `model.decoder.*`."""

    def __init__(self, config: PretrainedConfig) -> None:
        super().__init__()
        self.decoder = OPTDecoder(config)

    def forward(self, input_ids, positions, meta) -> torch.Tensor:
        return self.decoder(input_ids, positions, meta)


class OPTForCausalLM(CausalLM):
    packed_modules = {"qkv_proj": ["q_proj", "k_proj", "v_proj"]}

    def __init__(self, config: PretrainedConfig) -> None:
        super().__init__(config)
        self.model = OPTModel(config)
        self.lm_head = nn.Linear(config.word_embed_proj_dim, config.vocab_size, bias=False)
        self.tied = getattr(config, "tie_word_embeddings", True)  # True for every OPT release
        if self.tied:
            self.lm_head.weight = self.get_input_embeddings().weight

    def forward(self, input_ids, positions, meta) -> torch.Tensor:
        return self.model(input_ids, positions, meta)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden)  # [R, vocab]

    def kv_geometry(self) -> KVGeometry:
        block = self.model.decoder.layers[0].self_attn
        return KVGeometry(len(self.model.decoder.layers), block.num_heads, block.head_dim)

    def get_input_embeddings(self) -> nn.Embedding:
        return self.model.decoder.embed_tokens

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        if self.tied:
            self.tie_weights_after_materialise()  # idempotent; guards a to_empty() elsewhere
        load_into(self, (_normalise_name(name, t) for name, t in weights), self.packed_modules)


def _normalise_name(name: str, tensor: torch.Tensor) -> tuple[str, torch.Tensor]:
    """The original facebook/opt-* files name tensors `decoder.*` (no `model.` prefix)."""
    if name.startswith("decoder."):
        name = "model." + name
    return name, tensor
