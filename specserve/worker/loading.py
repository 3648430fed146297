"""Resolve, configure and build one model (target or draft) on a device."""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch
from transformers import PretrainedConfig

from specserve.model.base import CausalLM
from specserve.model.huge_pages import move_to_huge_pages
from specserve.model.layers import cpu_kernels
from specserve.model.layers.quantization import get_quantization_method, quantize_model
from specserve.model.layers.quantization.gguf_blocks import GGUFBlocks
from specserve.model.layers.weight_layout import store_linear_weights_input_major
from specserve.model.loader import ModelSource, iter_weights, load_hf_config, resolve_model
from specserve.model.registry import build_model

logger = logging.getLogger(__name__)


@dataclass
class LoadedModel:
    source: ModelSource
    hf_config: PretrainedConfig
    model: CausalLM

    @property
    def max_position_embeddings(self) -> int:
        cfg = self.hf_config
        return int(getattr(cfg, "max_position_embeddings", None)
                   or getattr(cfg, "max_sequence_length", None) or 2048)


def uses_gguf_blocks_by_default(source: ModelSource, dtype: torch.dtype,
                                device: torch.device) -> bool:
    """A float32 GGUF model on the CPU keeps its file's blocks (see gguf_blocks: same results,
    far fewer bytes per decode step) when the CPU kernels are there (not switched off with
    SPECSERVE_CPU_KERNELS=0, and built)."""
    return (source.is_gguf and device.type == "cpu" and dtype == torch.float32
            and cpu_kernels.load() is not None)


@contextmanager
def float32_matmul_precision(precision: str | None) -> Iterator[None]:
    """torch's float32 matmul precision set to `precision` while models load, then put back
    (None: left as it is). The GGUF layers read it at load (quantization/gguf_amx.py), so an
    engine's choice holds for its own layers without changing the process's setting."""
    if precision is None:
        yield
        return
    before = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision(precision)
    try:
        yield
    finally:
        torch.set_float32_matmul_precision(before)


def load_model(name: str | None, dtype: torch.dtype, device: torch.device,
               source: ModelSource | None = None,
               hf_config: PretrainedConfig | None = None,
               quantization: str | None = None) -> LoadedModel:
    t0 = time.perf_counter()
    source = source or resolve_model(name)
    hf_config = hf_config or load_hf_config(source)
    model = build_model(hf_config, iter_weights(source), dtype, device)
    if quantization is None and uses_gguf_blocks_by_default(source, dtype, device):
        quantization = GGUFBlocks.name
    if quantization is not None:
        quantize_model(model, get_quantization_method(quantization), device, source)
    if device.type == "cpu":
        store_linear_weights_input_major(model)  # MKL's fast layout for multi-row matmuls
        move_to_huge_pages(model)  # every step streams the weights: 2 MB pages (huge_pages.py)
    logger.info("loaded %s (%s) in %.2fs", source.name, type(model).__name__,
                time.perf_counter() - t0)
    return LoadedModel(source, hf_config, model)
