"""GGUF Q4_1 / Q8_0 blocks repacked for the 8-bit-activation VNNI kernel (csrc/gguf_a8_linear.cpp).

Why a module of its own: two users read this layout, ``quantization="gguf_a8"`` (gguf_a8.py, every
layer) and the greedy screen of the exact ``gguf`` head on VNNI CPUs (greedy_screen_vnni.py).

Layout: the kernel wants 16 output features side by side in the 16 lanes of a vector, so the
blocks are repacked once at load into groups of 16 weight rows (same bytes per weight: 20 per
32 Q4_1 values, 36 per 32 Q8_0 values, the extra 2 being the codes' sum).
"""

from __future__ import annotations

import torch

LANES = 16  # weight rows per packed group: one int32 lane each


def _groups(blocks: torch.Tensor, block_bytes: int) -> torch.Tensor:
    """[N, K / 32 * block_bytes] -> [N / 16 (rounded up), 16, K / 32, block_bytes], zero rows
    padding the last group."""
    n = blocks.shape[0]
    per_row = blocks.view(n, -1, block_bytes)  # [N, B, bytes]
    pad = (-n) % LANES
    if pad:
        per_row = torch.cat([per_row, per_row.new_zeros(pad, *per_row.shape[1:])])
    return per_row.view(-1, LANES, per_row.shape[1], block_bytes)


def pack_q4_1(blocks: torch.Tensor) -> torch.Tensor:
    """GGUF Q4_1 rows [N, K / 32 * 20] -> records [N / 16, K / 32, 320] (see gguf_a8_linear.cpp).

    A file byte j of a block holds input j (low nibble) and input 16 + j (high nibble), so chunk
    p of a record is just bytes 4p..4p+3 of each of the 16 rows, side by side."""
    g = _groups(blocks, 20)  # [G, 16, B, 20]
    codes = g[..., 4:].reshape(*g.shape[:3], 4, 4).permute(0, 2, 3, 1, 4)  # [G, B, p, 16, 4]
    d = g[..., 0:2].permute(0, 2, 1, 3)  # [G, B, 16, 2] float16 bytes
    m = g[..., 2:4].permute(0, 2, 1, 3)
    rec = torch.cat([codes.reshape(*codes.shape[:2], 256), d.reshape(*d.shape[:2], 32),
                     m.reshape(*m.shape[:2], 32)], dim=-1)
    return rec.contiguous()


def pack_q8_0(blocks: torch.Tensor) -> torch.Tensor:
    """GGUF Q8_0 rows [N, K / 32 * 34] -> records [N / 16, K / 32, 576]: 8 chunks of 4 codes
    per row, the 16 scales, and each row's int16 sum of codes."""
    g = _groups(blocks, 34)  # [G, 16, B, 34]
    codes = g[..., 2:].reshape(*g.shape[:3], 8, 4).permute(0, 2, 3, 1, 4)  # [G, B, p, 16, 4]
    d = g[..., 0:2].permute(0, 2, 1, 3)  # [G, B, 16, 2]
    sums = g[..., 2:].contiguous().view(torch.int8).sum(-1, dtype=torch.int16)  # [G, 16, B]
    sums = sums.permute(0, 2, 1).contiguous().view(torch.uint8)  # [G, B, 32]
    rec = torch.cat([codes.reshape(*codes.shape[:2], 512), d.reshape(*d.shape[:2], 32), sums],
                    dim=-1)
    return rec.contiguous()


PACKERS = {"Q4_1": pack_q4_1, "Q8_0": pack_q8_0}
