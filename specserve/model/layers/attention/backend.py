"""The attention backend interface: how K/V reach the paged cache and how queries read it."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

from specserve.model.layers.attention.metadata import AttentionMetadata

if TYPE_CHECKING:
    from specserve.model.layers.attention.layer import Attention
    from specserve.model.layers.rotary import RotaryEmbedding, RotaryTable

#: qkv [T, (H + 2 KvH) D] of one layer, that layer's Attention -> its output [T, H D]
LayerPass = Callable[[torch.Tensor, "Attention"], torch.Tensor]


class AttentionBackend(ABC):
    """One implementation per device family (torch reference, Triton on CUDA, ...)."""

    name: str = "abstract"
    #: True when ``forward``/``write_kv`` read nothing on the host, fix their launch shapes from
    #: the metadata's host fields alone, skip PAD_SLOT (-1) slots and sequences with query
    #: length 0: then a padded batch can be replayed from a CUDA graph (worker/cuda_graphs.py).
    supports_cuda_graphs: bool = False

    @abstractmethod
    def prepare(self, meta: AttentionMetadata) -> None:
        """Compute per-step layout once (gather indices, masks) before the layers run."""

    @abstractmethod
    def write_kv(self, key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor,
                 v_cache: torch.Tensor, meta: AttentionMetadata) -> None:
        """Store this step's keys/values ([num_tokens, kv_heads, head_dim]) at their slots."""

    def rotate_and_write_kv(self, qkv: torch.Tensor, rotary: RotaryEmbedding, rope: RotaryTable,
                            k_cache: torch.Tensor, v_cache: torch.Tensor,
                            meta: AttentionMetadata) -> torch.Tensor:
        """qkv [num_tokens, (H + 2 * kv_heads) * head_dim], a packed projection (q heads, then
        k heads, then v heads, not yet rotated) -> the rotated queries [num_tokens, H, head_dim];
        the rotated keys and the values are stored at their slots on the way.

        Why a backend method: the backend owns the cache write, so it may fuse the rotation into
        it (TritonAttentionBackend: one kernel instead of two per layer). This default is the
        unfused reference every backend gets: the rotary module's own rotate() over q and k
        together, then write_kv."""
        num_tokens = qkv.shape[0]
        kv_heads, head_dim = k_cache.shape[2], k_cache.shape[3]
        kv_size = kv_heads * head_dim
        q_size = qkv.shape[1] - 2 * kv_size
        num_heads = q_size // head_dim
        assert num_heads * head_dim == q_size, "qkv width is not (H + 2 * kv_heads) * head_dim"
        # q and k rotate together: one set of ops over H + KvH heads instead of two.
        qk = rotary.rotate(qkv[:, : q_size + kv_size].view(num_tokens, num_heads + kv_heads,
                                                           head_dim), rope)  # [T, H + KvH, D]
        value = qkv[:, q_size + kv_size :].view(num_tokens, kv_heads, head_dim)  # [T, KvH, D]
        self.write_kv(qk[:, num_heads:], value, k_cache, v_cache, meta)
        return qk[:, :num_heads]  # [T, H, D]

    @abstractmethod
    def forward(self, query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                meta: AttentionMetadata, scale: float) -> torch.Tensor:
        """Causal attention of each query run over its sequence's cached context.

        query: [num_tokens, num_heads, head_dim]; caches: [num_blocks, block_size, kv_heads,
        head_dim]. Returns [num_tokens, num_heads, head_dim].
        """

    def layer_pass(self, meta: AttentionMetadata, rotary: RotaryEmbedding,
                   rope: RotaryTable) -> LayerPass | None:
        """For a model that runs its layers in one flat loop (model/lean_forward.py): a function
        doing what ``Attention.forward_packed`` does for any layer of this step, with the
        step's choices made once, or None (this default) to keep forward_packed."""
        return None
