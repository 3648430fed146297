"""The attention layer the model files use: projections stay in the model, this owns the cache."""

from __future__ import annotations

import torch
from torch import nn

from specserve.model.layers.attention.backend import AttentionBackend
from specserve.model.layers.attention.metadata import AttentionMetadata
from specserve.model.layers.rotary import RotaryEmbedding, RotaryTable


class Attention(nn.Module):
    """Writes this step's K/V into the layer's paged cache, then attends over the whole context."""

    def __init__(self, num_heads: int, head_dim: int, num_kv_heads: int, scale: float) -> None:
        super().__init__()
        self.num_heads = num_heads
        self.head_dim = head_dim
        self.num_kv_heads = num_kv_heads
        self.scale = scale
        self.k_cache: torch.Tensor | None = None  # [num_blocks, block_size, kv_heads, head_dim]
        self.v_cache: torch.Tensor | None = None
        self.backend: AttentionBackend | None = None

    def bind(self, k_cache: torch.Tensor, v_cache: torch.Tensor, backend: AttentionBackend) -> None:
        self.k_cache, self.v_cache, self.backend = k_cache, v_cache, backend

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                meta: AttentionMetadata) -> torch.Tensor:
        """q: [T, H*D], k/v: [T, KvH*D] -> [T, H*D]."""
        assert self.backend is not None, "KV cache not bound: call ModelRunner.bind_kv_cache first"
        num_tokens = q.shape[0]
        q = q.view(num_tokens, self.num_heads, self.head_dim)
        k = k.view(num_tokens, self.num_kv_heads, self.head_dim)
        v = v.view(num_tokens, self.num_kv_heads, self.head_dim)
        self.backend.write_kv(k, v, self.k_cache, self.v_cache, meta)
        out = self.backend.forward(q, self.k_cache, self.v_cache, meta, self.scale)
        return out.reshape(num_tokens, self.num_heads * self.head_dim)

    def forward_packed(self, qkv: torch.Tensor, rotary: RotaryEmbedding, rope: RotaryTable,
                       meta: AttentionMetadata) -> torch.Tensor:
        """qkv [T, (H + 2*KvH) * D], the un-rotated packed projection -> [T, H*D].

        For rotary models: the backend rotates q and k and writes K/V in one go (see
        AttentionBackend.rotate_and_write_kv), which a fused backend does in one kernel."""
        assert self.backend is not None, "KV cache not bound: call ModelRunner.bind_kv_cache first"
        num_tokens = qkv.shape[0]
        q = self.backend.rotate_and_write_kv(qkv, rotary, rope, self.k_cache, self.v_cache,
                                             meta)  # [T, H, D]
        out = self.backend.forward(q, self.k_cache, self.v_cache, meta, self.scale)
        return out.reshape(num_tokens, self.num_heads * self.head_dim)
