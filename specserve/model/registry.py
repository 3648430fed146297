"""Architecture name (from config.json "architectures") -> our module class."""

from __future__ import annotations

import importlib

import torch
from transformers import PretrainedConfig

from specserve.model.base import CausalLM

# name -> (module, class); imported lazily so one broken file cannot break the others.
_ARCHITECTURES: dict[str, tuple[str, str]] = {
    "LlamaForCausalLM": ("specserve.model.llama", "LlamaForCausalLM"),
    "MistralForCausalLM": ("specserve.model.llama", "LlamaForCausalLM"),
    "Qwen2ForCausalLM": ("specserve.model.llama", "Qwen2ForCausalLM"),
    "OPTForCausalLM": ("specserve.model.opt", "OPTForCausalLM"),
}


def supported_architectures() -> list[str]:
    return sorted(_ARCHITECTURES)


def model_class_for(config: PretrainedConfig) -> type[CausalLM]:
    names = list(getattr(config, "architectures", None) or [])
    for name in names:
        if name in _ARCHITECTURES:
            module, cls = _ARCHITECTURES[name]
            return getattr(importlib.import_module(module), cls)
    raise ValueError(
        f"model architecture {names or getattr(config, 'model_type', '?')} is not supported; "
        f"supported architectures: {supported_architectures()}."
    )


def build_model(config: PretrainedConfig, weights, dtype: torch.dtype,
                device: torch.device) -> CausalLM:
    """Construct without random init (meta device), materialise on the device, load weights."""
    cls = model_class_for(config)
    with torch.device("meta"):
        model = cls(config)
    # Cast on the meta device first (free), so no full-precision copy is ever allocated.
    model = model.to(dtype).to_empty(device=device)
    if getattr(config, "tie_word_embeddings", False) and hasattr(model, "lm_head"):
        # to_empty() breaks parameter sharing; restore the tie before loading.
        model.tie_weights_after_materialise()
    model.load_weights(((name, t.to(device=device, dtype=dtype)) for name, t in weights))
    return model.eval()
