"""Reference attention in plain torch: gather each sequence's KV through its block table.

Queries and keys are laid out as a padded batch ``[num_seqs, max_query_len]`` x
``[num_seqs, max_seq_len]`` and one batched SDPA call serves prefill chunks, decodes and
multi-token verification together. Padding is cheap at CPU batch sizes and keeps the number of
kernel launches per layer constant, which matters more on CPU than the wasted FLOPs.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from specserve.model.layers.attention.backend import AttentionBackend
from specserve.model.layers.attention.metadata import AttentionMetadata


class TorchAttentionBackend(AttentionBackend):
    name = "torch"

    def prepare(self, meta: AttentionMetadata) -> None:
        device = meta.slot_mapping.device
        num_seqs, max_q, max_k = meta.num_seqs, meta.max_query_len, meta.max_seq_len
        query_lens = torch.tensor(meta.query_lens, dtype=torch.int64, device=device)  # [S]
        seq_lens = meta.seq_lens.to(torch.int64)  # [S]
        starts = meta.query_start_loc[:-1].to(torch.int64)  # [S]
        q_offsets = torch.arange(max_q, device=device)  # [Q]
        q_valid = q_offsets[None, :] < query_lens[:, None]  # [S, Q]
        q_index = (starts[:, None] + q_offsets[None, :]).clamp(max=meta.num_tokens - 1)  # [S, Q]
        # Absolute position of each query: context before the run plus its offset in the run.
        q_pos = (seq_lens - query_lens)[:, None] + q_offsets[None, :]  # [S, Q]
        k_pos = torch.arange(max_k, device=device)  # [K]
        mask = (k_pos[None, None, :] <= q_pos[:, :, None]) & (
            k_pos[None, None, :] < seq_lens[:, None, None]
        )  # [S, Q, K]
        # Padded query rows attend to key 0 so that softmax never sees an all-masked row.
        mask[:, :, 0] = True
        bs = meta.block_size
        block_idx = meta.block_tables[:, : (max_k + bs - 1) // bs].to(torch.int64)  # [S, nb]
        slots = (block_idx[:, :, None] * bs + torch.arange(bs, device=device)).reshape(num_seqs, -1)
        meta.backend_state["torch"] = {
            "q_valid": q_valid,
            "q_index": q_index,
            "kv_slots": slots[:, :max_k],  # [S, K]
            "mask": mask[:, None, :, :],  # [S, 1, Q, K]
        }

    def write_kv(self, key, value, k_cache, v_cache, meta) -> None:
        k_cache.view(-1, *k_cache.shape[2:])[meta.slot_mapping] = key
        v_cache.view(-1, *v_cache.shape[2:])[meta.slot_mapping] = value

    def forward(self, query, k_cache, v_cache, meta, scale) -> torch.Tensor:
        state = meta.backend_state["torch"]
        num_heads, head_dim = query.shape[1], query.shape[2]
        kv_heads = k_cache.shape[2]
        q = query[state["q_index"]].transpose(1, 2)  # [S, H, Q, D]
        flat_k = k_cache.view(-1, kv_heads, head_dim)
        flat_v = v_cache.view(-1, kv_heads, head_dim)
        k = flat_k[state["kv_slots"]].transpose(1, 2)  # [S, KvH, K, D]
        v = flat_v[state["kv_slots"]].transpose(1, 2)  # [S, KvH, K, D]
        out = F.scaled_dot_product_attention(
            q, k, v, attn_mask=state["mask"], scale=scale, enable_gqa=num_heads != kv_heads
        )  # [S, H, Q, D]
        return out.transpose(1, 2)[state["q_valid"]]  # [T, H, D]
