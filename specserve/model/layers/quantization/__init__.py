"""Post-load weight quantization (``quantization=`` option). Methods by name."""

from specserve.model.layers.quantization.base import QuantizationMethod, quantize_model
from specserve.model.layers.quantization.gguf_a8 import GGUFBlocksA8
from specserve.model.layers.quantization.gguf_blocks import GGUFBlocks
from specserve.model.layers.quantization.int4 import Int4WeightOnly
from specserve.model.layers.quantization.int8 import DynamicInt8

QUANTIZATION_METHODS: dict[str, type[QuantizationMethod]] = {
    method.name: method for method in (GGUFBlocks, GGUFBlocksA8, Int4WeightOnly, DynamicInt8)
}


def get_quantization_method(name: str) -> QuantizationMethod:
    try:
        return QUANTIZATION_METHODS[name]()
    except KeyError:
        raise ValueError(f"quantization={name!r} is not supported; choose one of "
                         f"{sorted(QUANTIZATION_METHODS)} or leave it unset.") from None


__all__ = ["QUANTIZATION_METHODS", "QuantizationMethod", "get_quantization_method",
           "quantize_model"]
