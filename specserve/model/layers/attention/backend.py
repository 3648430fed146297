"""The attention backend interface: how K/V reach the paged cache and how queries read it."""

from __future__ import annotations

from abc import ABC, abstractmethod

import torch

from specserve.model.layers.attention.metadata import AttentionMetadata


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

    @abstractmethod
    def forward(self, query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                meta: AttentionMetadata, scale: float) -> torch.Tensor:
        """Causal attention of each query run over its sequence's cached context.

        query: [num_tokens, num_heads, head_dim]; caches: [num_blocks, block_size, kv_heads,
        head_dim]. Returns [num_tokens, num_heads, head_dim].
        """
