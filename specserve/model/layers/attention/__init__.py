"""Paged attention: metadata, the backend interface, and the layer the models use."""

from specserve.model.layers.attention.backend import AttentionBackend
from specserve.model.layers.attention.layer import Attention
from specserve.model.layers.attention.metadata import AttentionMetadata
from specserve.model.layers.attention.selector import get_attention_backend

__all__ = ["Attention", "AttentionBackend", "AttentionMetadata", "get_attention_backend"]
