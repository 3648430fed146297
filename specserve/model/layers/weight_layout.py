"""Float32 linear weights on CPU stored input-major: ``[in, out]`` in memory, seen as ``[out, in]``.

Why: ``F.linear(x, W)`` with ``W`` row-major ``[out, in]`` asks MKL's sgemm for ``x @ W^T``.
From 4 rows of ``x`` on, MKL takes a path for that layout that is 2-3x slower than the same
product with the weight stored transposed, which is exactly the regime of speculative
verification (k + 1 rows per sequence) and of batched decoding. Measured on the 2-core CI
machine (torch 2.13, MKL 2024.2, SmolLM2-135M shapes, microseconds, row-major / input-major):
qkv 576->960 at 6 rows 133 / 50, at 32 rows 244 / 163; down 1536->576 at 32 rows 632 / 346;
lm_head 576->49152 at 1 row 3730 / 2590. From 4 rows on the results are bit-identical (MKL
then computes both the same way, only slower for the row-major one); at 1-3 rows they differ in
the last bits (about 1e-5), as any two GEMM kernels do.

The module keeps its ``[out, in]`` weight, now a transposed view of an ``[in, out]`` tensor, so
nothing else changes: ``F.linear`` sees that ``weight.t()`` is contiguous and calls the fast
layout, tied embeddings share the same parameter (a lookup then reads strided columns: ~0.2 ms
for 32 tokens, ~1 ms for a 300-token prompt, small beside the matmuls of those steps), and
weights are loaded (and quantized, if asked) before the layout changes.
"""

from __future__ import annotations

import torch
from torch import nn


def store_linear_weights_input_major(model: nn.Module) -> int:
    """Re-store every float32 CPU ``nn.Linear`` weight of model input-major; returns how many
    weight tensors were changed (a weight tied to an embedding counts once). A GGUFBlockLinear
    never multiplies by a dense weight (the one a tied head keeps is the embedding table, which
    stays row-major for its lookups)."""
    changed: set[int] = set()
    for module in model.modules():
        if not isinstance(module, nn.Linear):
            continue
        weight = module.weight
        if (id(weight) in changed or weight.device.type != "cpu"
                or weight.dtype != torch.float32 or not weight.is_contiguous()):
            continue
        weight.data = weight.data.t().contiguous().t()  # [out, in] view of [in, out] memory
        changed.add(id(weight))
    return len(changed)
