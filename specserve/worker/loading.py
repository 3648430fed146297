"""Resolve, configure and build one model (target or draft) on a device."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import torch
from transformers import PretrainedConfig

from specserve.model.base import CausalLM
from specserve.model.layers.quantization import get_quantization_method, quantize_model
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


def load_model(name: str | None, dtype: torch.dtype, device: torch.device,
               source: ModelSource | None = None,
               hf_config: PretrainedConfig | None = None,
               quantization: str | None = None) -> LoadedModel:
    t0 = time.perf_counter()
    source = source or resolve_model(name)
    hf_config = hf_config or load_hf_config(source)
    model = build_model(hf_config, iter_weights(source), dtype, device)
    if quantization is not None:
        quantize_model(model, get_quantization_method(quantization), device)
    if device.type == "cpu":
        store_linear_weights_input_major(model)  # MKL's fast layout for multi-row matmuls
    logger.info("loaded %s (%s) in %.2fs", source.name, type(model).__name__,
                time.perf_counter() - t0)
    return LoadedModel(source, hf_config, model)
