"""Copy Hugging Face tensors into our modules, including fused (packed) projections.

Our models fuse q/k/v and gate/up into single matmuls (fewer launches per layer); checkpoints
keep them apart, so a packed-module table says which slice each checkpoint tensor fills.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

# fused parameter name fragment -> checkpoint fragments in slice order
PackedModules = dict[str, list[str]]


def load_into(model: nn.Module, weights: Iterable[tuple[str, torch.Tensor]],
              packed: PackedModules, ignore_prefixes: tuple[str, ...] = ()) -> None:
    """Copy each checkpoint tensor into its (possibly fused) parameter.

    Raises if the checkpoint lacks a parameter the model needs: a silently random layer would
    produce plausible-looking garbage.
    """
    params = dict(model.named_parameters())
    filled: set[str] = set()
    shard_index = {frag: (fused, i) for fused, frags in packed.items() for i, frag in enumerate(frags)}
    for name, tensor in weights:
        if name.startswith(ignore_prefixes) or "rotary_emb.inv_freq" in name:
            continue
        target, shard = name, None
        for frag, (fused, i) in shard_index.items():
            if f".{frag}." in name:
                target, shard = name.replace(f".{frag}.", f".{fused}."), i
                break
        if target not in params:
            continue  # e.g. lm_head.weight when embeddings are tied
        param = params[target]
        with torch.no_grad():
            if shard is None:
                if param.shape != tensor.shape:
                    raise ValueError(
                        f"checkpoint tensor {name} has shape {tuple(tensor.shape)}, model expects "
                        f"{tuple(param.shape)}: the config does not match the weights."
                    )
                param.copy_(tensor)
            else:
                sizes = _shard_sizes(model, target)
                offset = sum(sizes[:shard])
                param[offset : offset + sizes[shard]].copy_(tensor)
        filled.add(f"{target}#{shard}")
    missing = []
    for pname in params:
        sizes = _shard_sizes(model, pname)
        keys = [f"{pname}#{i}" for i in range(len(sizes))] if sizes else [f"{pname}#None"]
        if not all(k in filled for k in keys):
            missing.append(pname)
    if missing:
        raise ValueError(f"checkpoint is missing weights for: {missing[:8]}"
                         + (" ..." if len(missing) > 8 else ""))


class PackedLinear(nn.Linear):
    """A Linear whose output rows are the concatenation of several checkpoint projections."""

    def __init__(self, in_features: int, shard_sizes: list[int], bias: bool) -> None:
        super().__init__(in_features, sum(shard_sizes), bias=bias)
        self.shard_sizes = list(shard_sizes)


def _shard_sizes(model: nn.Module, param_name: str) -> list[int] | None:
    module = model.get_submodule(param_name.rsplit(".", 1)[0]) if "." in param_name else model
    return module.shard_sizes if isinstance(module, PackedLinear) else None


def fused_linear(in_features: int, shard_sizes: list[int], bias: bool) -> PackedLinear:
    return PackedLinear(in_features, shard_sizes, bias)
