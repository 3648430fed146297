"""What one forward pass needs to know about the batch to read and write the paged KV cache.

Every scheduled sequence contributes a contiguous run of query tokens: a prompt chunk, one decode
token, or ``[last token] + k proposals`` when speculation is verified. One layout serves all three,
so verification is just a decode whose query run is longer than one.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [num_tokens] int64: flat cache slot for each new token's K/V
    block_tables: torch.Tensor  # [num_seqs, max_blocks] int32: physical block ids, 0-padded
    seq_lens: torch.Tensor  # [num_seqs] int32: context length after this step's tokens
    query_start_loc: torch.Tensor  # [num_seqs + 1] int32: offsets of each query run
    query_lens: list[int]  # host copies, for building backend-specific layouts
    seq_lens_host: list[int]
    max_query_len: int
    max_seq_len: int
    block_size: int
    # Host copy of block_tables, unpadded (None where the builder had none): the CPU context
    # mirror compares tables on the host (torch_context_mirror.ContextMirror.plan)
    block_tables_host: list[list[int]] | None = None
    # Backend-owned scratch computed once per step and shared by all layers.
    backend_state: dict[str, Any] = field(default_factory=dict)

    @property
    def num_seqs(self) -> int:
        return len(self.query_lens)

    @property
    def num_tokens(self) -> int:
        return int(self.slot_mapping.shape[0])
