"""The interface every architecture implements, so the runner never needs to know which one."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterable
from dataclasses import dataclass

import torch
from torch import nn
from transformers import PretrainedConfig

from specserve.model.layers import fused_argmax
from specserve.model.layers.attention import Attention, AttentionMetadata
from specserve.model.weights import PackedModules, load_into


@dataclass(frozen=True)
class KVGeometry:
    """What the KV cache allocator needs to know about a model."""

    num_layers: int
    num_kv_heads: int
    head_dim: int


def tensor_bytes(module: nn.Module) -> int:
    """Bytes held by ``module``'s parameters *and* buffers, each storage counted once.

    Buffers count because quantized weights live in them (``quantize_model`` registers the
    packed int4/int8 codes and their scales as buffers, not parameters), so parameters alone
    would miss most of a quantized model. Tensors are keyed by data pointer, so a tensor shared
    between submodules (a tied embedding, or a draft sharing the target's embedding when both
    sit in one container) is counted once."""
    seen: dict[int, int] = {}
    for t in list(module.parameters()) + list(module.buffers()):
        seen[t.data_ptr()] = t.numel() * t.element_size()
    return sum(seen.values())


class CausalLM(nn.Module, ABC):
    """A decoder-only LM over flat token batches ([num_tokens]) with paged attention."""

    packed_modules: PackedModules = {}

    def __init__(self, config: PretrainedConfig) -> None:
        super().__init__()
        self.config = config

    @abstractmethod
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                meta: AttentionMetadata) -> torch.Tensor:
        """input_ids, positions: [T] -> final hidden states [T, hidden]."""

    @abstractmethod
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden: [R, hidden] -> logits [R, vocab] (only the rows that get sampled)."""

    def greedy_tokens(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden: [R, hidden] -> [R] int64, the argmax of each row's logits (greedy steps). A
        model whose head can find it without every logit overrides this (llama.py: a GGUF head
        on AMX tiles, quantization/greedy_screen.py, or on VNNI, greedy_screen_vnni.py)."""
        return fused_argmax.logits_argmax(self.compute_logits(hidden))

    @abstractmethod
    def kv_geometry(self) -> KVGeometry: ...

    @property
    def vocab_size(self) -> int:
        return int(self.config.vocab_size)

    def attention_layers(self) -> list[Attention]:
        return [m for m in self.modules() if isinstance(m, Attention)]

    def tie_weights_after_materialise(self) -> None:
        """Re-share input and output embeddings (to_empty() allocates them separately)."""
        self.lm_head.weight = self.get_input_embeddings().weight

    def get_input_embeddings(self) -> nn.Embedding:
        return self.model.embed_tokens

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        load_into(self, weights, self.packed_modules)
