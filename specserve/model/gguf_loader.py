"""GGUF checkpoints: parse once, then build a Hugging Face config, weights and tokenizer from it.

A GGUF file is one self-describing blob: a key/value metadata table (the model's hyperparameters
and its whole tokenizer), a tensor table, then the tensor data. ``gguf.GGUFReader`` exposes every
string of the vocabulary as its own numpy view, which costs ~2.7 s on SmolLM2's 49k tokens and
49k merges; transformers' GGUF paths re-parse the file for the config, the tokenizer and the
weights separately. Here the header is walked once with ``struct`` on an ``mmap`` (~0.1 s), cached
per file, and shared by all three. Tensor data stays in the mapping until a weight is requested.

Only the *format* is ours to parse; dequantization is delegated to ``gguf.quants``.
"""

from __future__ import annotations

import functools
import mmap
import re
import struct
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf.quants import dequantize

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

GGUF_MAGIC = b"GGUF"
SUPPORTED_GGUF_VERSIONS = (2, 3)  # v1 used 32-bit counts and is long gone
DEFAULT_ALIGNMENT = 32  # llama.cpp's default when `general.alignment` is absent

# metadata value type id -> struct format, for the fixed-size types (u8 i8 u16 i16 u32 i32 f32 bool
# u64 i64 f64); 8 (string) and 9 (array) are variable-length
_SCALAR_FORMATS = dict(zip((0, 1, 2, 3, 4, 5, 6, 7, 10, 11, 12), "BbHhIif?Qqd", strict=True))
_STRING_TYPE = 8
_ARRAY_TYPE = 9

# float types whose bytes are reinterpreted, not dequantized; they keep their dtype
_FLOAT_TYPES = {
    GGMLQuantizationType.F32: torch.float32,
    GGMLQuantizationType.F16: torch.float16,
    GGMLQuantizationType.BF16: torch.bfloat16,
}
_NUMPY_VIEW = {torch.float32: np.float32, torch.float16: np.float16, torch.bfloat16: np.int16}


@dataclass(frozen=True)
class GGUFArch:
    """How one llama.cpp architecture maps onto a transformers model."""

    model_type: str  # transformers model_type
    hf_class: str  # config.architectures[0]
    permute_qk: bool  # llama.cpp's converter interleaved Q/K rows for its rope kernel


GGUF_ARCHS = {
    "llama": GGUFArch("llama", "LlamaForCausalLM", permute_qk=True),
    "qwen2": GGUFArch("qwen2", "Qwen2ForCausalLM", permute_qk=False),
    "qwen3": GGUFArch("qwen3", "Qwen3ForCausalLM", permute_qk=False),
}

# GGUF block-tensor name -> HF name inside `model.layers.N.`
_LAYER_NAMES = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
}
_TOP_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
# tensors llama.cpp adds that have no HF parameter; skipped with a warning
_IGNORED_TENSORS = {"rope_freqs.weight"}
_BLOCK_RE = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")


@dataclass(frozen=True)
class GGUFTensorInfo:
    """Where one tensor lives in the file and how it is stored."""

    name: str
    shape: tuple[int, ...]  # torch order (GGUF stores dims fastest-first, i.e. reversed)
    ggml_type: int
    offset: int  # absolute byte offset in the file
    nbytes: int


@dataclass(frozen=True, eq=False)
class GGUFFile:
    """A parsed GGUF: all metadata, the tensor table, and a read-only view of the bytes."""

    path: Path
    metadata: dict[str, Any]
    tensors: dict[str, GGUFTensorInfo]  # file order
    data: np.ndarray  # [file_size] uint8, backed by an mmap

    @property
    def architecture(self) -> str:
        return self.metadata["general.architecture"]

    def arch_key(self, key: str, default: Any = None) -> Any:
        """An architecture-scoped key, e.g. ``arch_key("block_count")`` -> ``llama.block_count``."""
        return self.metadata.get(f"{self.architecture}.{key}", default)


def read_gguf(path: str | Path) -> GGUFFile:
    """Parse ``path`` once; later calls for an unchanged file return the cached parse."""
    resolved = Path(path).expanduser().resolve()
    stat = resolved.stat()
    return _read_gguf_cached(resolved, stat.st_mtime_ns, stat.st_size)


@functools.lru_cache(maxsize=4)
def _read_gguf_cached(path: Path, mtime_ns: int, size: int) -> GGUFFile:
    """Cache key includes mtime and size so a rewritten file is re-parsed, not served stale."""
    del mtime_ns, size
    with open(path, "rb") as f:
        if f.read(4) != GGUF_MAGIC:
            raise ValueError(
                f"{path} is not a GGUF file (it does not start with b'GGUF'); pass a .gguf file "
                "written by llama.cpp's converter, or a Hugging Face model directory."
            )
        buf = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)  # stays valid after close
    version, tensor_count, kv_count = struct.unpack_from("<IQQ", buf, 4)
    if version not in SUPPORTED_GGUF_VERSIONS:
        raise ValueError(
            f"{path} is GGUF version {version}; supported versions are "
            f"{SUPPORTED_GGUF_VERSIONS}. Re-convert it with a current llama.cpp."
        )
    pos = 24
    metadata: dict[str, Any] = {}
    for _ in range(kv_count):
        key, pos = _read_string(buf, pos)
        (value_type,) = struct.unpack_from("<I", buf, pos)
        metadata[key], pos = _read_value(buf, pos + 4, value_type, path)
    if "general.architecture" not in metadata:
        raise ValueError(f"{path} has no 'general.architecture' metadata; the file is incomplete.")

    raw_infos = []
    for _ in range(tensor_count):
        name, pos = _read_string(buf, pos)
        (n_dims,) = struct.unpack_from("<I", buf, pos)
        dims = struct.unpack_from(f"<{n_dims}Q", buf, pos + 4)
        ggml_type, offset = struct.unpack_from("<IQ", buf, pos + 4 + 8 * n_dims)
        pos += 4 + 8 * n_dims + 12
        raw_infos.append((name, tuple(reversed(dims)), ggml_type, offset))

    alignment = metadata.get("general.alignment", DEFAULT_ALIGNMENT)
    data_start = (pos + alignment - 1) // alignment * alignment
    tensors = {}
    for name, shape, ggml_type, offset in raw_infos:
        nbytes = _tensor_nbytes(ggml_type, shape, name, path)
        tensors[name] = GGUFTensorInfo(name, shape, ggml_type, data_start + offset, nbytes)
    data = np.frombuffer(buf, dtype=np.uint8)  # [file_size]
    return GGUFFile(path=path, metadata=metadata, tensors=tensors, data=data)


def _read_string(buf: mmap.mmap, pos: int) -> tuple[str, int]:
    (length,) = struct.unpack_from("<Q", buf, pos)
    end = pos + 8 + length
    return buf[pos + 8 : end].decode("utf-8"), end


def _read_value(buf: mmap.mmap, pos: int, value_type: int, path: Path) -> tuple[Any, int]:
    """One metadata value and the offset just past it."""
    if value_type in _SCALAR_FORMATS:
        fmt = "<" + _SCALAR_FORMATS[value_type]
        return struct.unpack_from(fmt, buf, pos)[0], pos + struct.calcsize(fmt)
    if value_type == _STRING_TYPE:
        return _read_string(buf, pos)
    if value_type == _ARRAY_TYPE:
        item_type, count = struct.unpack_from("<IQ", buf, pos)
        pos += 12
        if item_type in _SCALAR_FORMATS:
            fmt = f"<{count}{_SCALAR_FORMATS[item_type]}"
            return list(struct.unpack_from(fmt, buf, pos)), pos + struct.calcsize(fmt)
        items = []
        for _ in range(count):  # strings (or nested arrays): variable length, walk them
            item, pos = _read_value(buf, pos, item_type, path)
            items.append(item)
        return items, pos
    raise ValueError(f"{path}: unknown GGUF metadata value type {value_type}; file is corrupt?")


def _tensor_nbytes(ggml_type: int, shape: tuple[int, ...], name: str, path: Path) -> int:
    try:
        qtype = GGMLQuantizationType(ggml_type)
        block_size, type_size = GGML_QUANT_SIZES[qtype]
    except (ValueError, KeyError):
        raise ValueError(
            f"{path}: tensor {name!r} has ggml type {ggml_type}, which the installed gguf "
            "package does not know; upgrade it with `pip install -U gguf`."
        ) from None
    elements = int(np.prod(shape))
    if shape and shape[-1] % block_size:
        raise ValueError(
            f"{path}: tensor {name!r} row of {shape[-1]} is not a multiple of "
            f"{qtype.name}'s block size {block_size}; the file is corrupt."
        )
    return elements // block_size * type_size


# ---------------------------------------------------------------------------------------------
# config


def gguf_arch(gf: GGUFFile) -> GGUFArch:
    """The architecture entry for this file, or a ValueError naming what is supported."""
    arch = gf.architecture
    if arch not in GGUF_ARCHS:
        raise ValueError(
            f"GGUF architecture {arch!r} ({gf.path}) is not supported; supported: "
            f"{sorted(GGUF_ARCHS)}. Use the model's Hugging Face safetensors checkpoint instead."
        )
    return GGUF_ARCHS[arch]


def gguf_config_dict(gf: GGUFFile) -> dict[str, Any]:
    """The transformers config kwargs this file's metadata implies (model_type included)."""
    arch = gguf_arch(gf)
    md = gf.metadata
    heads = gf.arch_key("attention.head_count")
    kv_heads = gf.arch_key("attention.head_count_kv", heads)
    hidden = gf.arch_key("embedding_length")
    vocab = gf.arch_key("vocab_size") or len(md.get("tokenizer.ggml.tokens", ())) or None
    cfg: dict[str, Any] = {
        "model_type": arch.model_type,
        "architectures": [arch.hf_class],
        "vocab_size": vocab,
        "hidden_size": hidden,
        "intermediate_size": gf.arch_key("feed_forward_length"),
        "num_hidden_layers": gf.arch_key("block_count"),
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "max_position_embeddings": gf.arch_key("context_length"),
        "rms_norm_eps": gf.arch_key("attention.layer_norm_rms_epsilon"),
        "rope_theta": gf.arch_key("rope.freq_base", 10000.0),
        "head_dim": gf.arch_key("attention.key_length")
        or gf.arch_key("rope.dimension_count")
        or hidden // heads,
        # llama.cpp writes no output.weight when the LM head reuses the embedding
        "tie_word_embeddings": "output.weight" not in gf.tensors,
        "dtype": gguf_dtype(gf),
    }
    missing = [k for k, v in cfg.items() if v is None]
    if missing:
        raise ValueError(
            f"{gf.path}: GGUF metadata lacks what is needed for {missing}; "
            "the file was not written by a recent llama.cpp converter."
        )
    for hf_key in ("bos", "eos", "unknown", "padding"):
        token_id = md.get(f"tokenizer.ggml.{hf_key}_token_id")
        if token_id is not None:
            cfg[{"unknown": "unk", "padding": "pad"}.get(hf_key, hf_key) + "_token_id"] = token_id
    eot = md.get("tokenizer.ggml.eot_token_id")  # e.g. Llama 3's <|eot_id|> also ends a turn
    if eot is not None and cfg.get("eos_token_id") not in (None, eot):
        cfg["eos_token_id"] = [cfg["eos_token_id"], eot]
    return cfg


def gguf_dtype(gf: GGUFFile) -> torch.dtype:
    """float32 when anything is quantized (dequantized values are float32), else the half type."""
    types = {info.ggml_type for info in gf.tensors.values()}
    if not types <= set(_FLOAT_TYPES):
        return torch.float32
    for half in (GGMLQuantizationType.BF16, GGMLQuantizationType.F16):
        if half in types:  # norms stay F32 beside half matrices; the half type is the model's
            return _FLOAT_TYPES[half]
    return torch.float32


# ---------------------------------------------------------------------------------------------
# weights


def gguf_to_hf_name(name: str) -> str | None:
    """``blk.3.attn_q.weight`` -> ``model.layers.3.self_attn.q_proj.weight``; None if unknown."""
    if m := _BLOCK_RE.fullmatch(name):
        layer, part, suffix = m.groups()
        hf_part = _LAYER_NAMES.get(part)
        return None if hf_part is None else f"model.layers.{layer}.{hf_part}.{suffix}"
    base, _, suffix = name.rpartition(".")
    hf_base = _TOP_NAMES.get(base)
    return None if hf_base is None or suffix not in ("weight", "bias") else f"{hf_base}.{suffix}"


def iter_gguf_weights(path: str | Path) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield ``(hf_name, tensor)`` one tensor at a time; quantized tensors come out float32."""
    gf = read_gguf(path)
    gguf_arch(gf)  # an unsupported architecture fails here, before any tensor is read
    for info in gf.tensors.values():
        if info.name in _IGNORED_TENSORS:
            warnings.warn(
                f"{gf.path}: skipping {info.name!r}; it has no Hugging Face parameter "
                "(llama3-style rope scaling is not reconstructed).",
                stacklevel=2,
            )
            continue
        hf_name = gguf_to_hf_name(info.name)
        if hf_name is None:
            raise ValueError(
                f"{gf.path}: GGUF tensor {info.name!r} has no Hugging Face name in the "
                f"{gf.architecture!r} mapping; this file's variant is not supported."
            )
        yield hf_name, hf_row_order(gf, info, dequantize_tensor(gf, info))


def dequantize_tensor(gf: GGUFFile, info: GGUFTensorInfo) -> torch.Tensor:
    """Decode one tensor to torch in HF shape; float types keep their dtype, the rest -> f32."""
    raw = gf.data[info.offset : info.offset + info.nbytes]  # [nbytes] uint8, read-only mmap view
    dtype = _FLOAT_TYPES.get(info.ggml_type)
    if dtype is not None:
        values = raw.view(_NUMPY_VIEW[dtype]).copy()  # copy: own the memory, writable
        return torch.from_numpy(values).view(dtype).reshape(info.shape)
    qtype = GGMLQuantizationType(info.ggml_type)
    block_size, type_size = GGML_QUANT_SIZES[qtype]
    row_bytes = info.shape[-1] // block_size * type_size
    values = dequantize(raw.reshape(-1, row_bytes), qtype)  # [rows, row] float32, fresh array
    return torch.from_numpy(np.ascontiguousarray(values, dtype=np.float32)).reshape(info.shape)


# block types the CPU kernels read as they are (layers/quantization/gguf_blocks.py)
KERNEL_BLOCK_TYPES = {GGMLQuantizationType.Q4_1: "Q4_1", GGMLQuantizationType.Q8_0: "Q8_0"}


def linear_blocks(path: str | Path, model: torch.nn.Module) -> dict[str, tuple[torch.Tensor, str]]:
    """Raw GGUF blocks for each ``nn.Linear`` of ``model`` stored in a kernel block type.

    Returns ``{module path: (blocks [out, in / 32 * block bytes] uint8, type name)}``. A fused
    projection (``qkv_proj``) gets its parts' rows concatenated in the model's packed order, so
    all parts must share one type; the tied ``lm_head`` reads the embedding's blocks. Q/K rows get
    the same un-interleave as their dequantized weights (a row permutation: blocks stay whole)."""
    gf = read_gguf(path)
    by_hf_name = {gguf_to_hf_name(info.name): info for info in gf.tensors.values()}
    if "lm_head.weight" not in by_hf_name and "model.embed_tokens.weight" in by_hf_name:
        by_hf_name["lm_head.weight"] = by_hf_name["model.embed_tokens.weight"]  # tied
    packed = getattr(model, "packed_modules", {})
    found: dict[str, tuple[torch.Tensor, str]] = {}
    for name, module in model.named_modules():
        if not isinstance(module, torch.nn.Linear):
            continue
        prefix, _, leaf = name.rpartition(".")
        parts = [f"{prefix}.{p}" if prefix else p for p in packed.get(leaf, [leaf])]
        infos = [by_hf_name.get(f"{part}.weight") for part in parts]
        if any(info is None for info in infos) or len({i.ggml_type for i in infos}) != 1:
            continue
        type_name = KERNEL_BLOCK_TYPES.get(GGMLQuantizationType(infos[0].ggml_type))
        if type_name is None:
            continue
        rows = []
        for info in infos:
            raw = torch.from_numpy(gf.data[info.offset : info.offset + info.nbytes].copy())
            rows.append(hf_row_order(gf, info, raw.reshape(info.shape[0], -1)))  # [out, bytes]
        found[name] = (torch.cat(rows).contiguous(), type_name)
    return found


def hf_row_order(gf: GGUFFile, info: GGUFTensorInfo, rows: torch.Tensor) -> torch.Tensor:
    """``rows`` [out, ...] of tensor ``info`` (dequantized values or raw blocks, one row per
    output feature) in Hugging Face's order: Q/K un-interleaved where the architecture's
    converter interleaved them, everything else unchanged."""
    if not gguf_arch(gf).permute_qk:
        return rows
    if ".attn_q." in info.name:
        return unpermute_qk(rows, gf.arch_key("attention.head_count"))
    if ".attn_k." in info.name:
        heads = gf.arch_key("attention.head_count")
        return unpermute_qk(rows, gf.arch_key("attention.head_count_kv", heads))
    return rows


def unpermute_qk(weight: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Undo llama.cpp's Q/K row interleave (``convert_hf_to_gguf.LlamaModel.permute``).

    llama.cpp reorders each head's rows from HF's rotate-half layout [first half, second half]
    into interleaved pairs for its rope kernel: ``w.reshape(h, 2, d/2, ...).swapaxes(1, 2)``.
    The inverse views rows as ``(h, d/2, 2)`` and swaps back.
    """
    rows = weight.shape[0]  # [heads * head_dim, ...]
    half = rows // n_heads // 2
    w = weight.reshape(n_heads, half, 2, *weight.shape[1:])
    return w.transpose(1, 2).reshape(weight.shape).contiguous()


# ---------------------------------------------------------------------------------------------
# tokenizer

# GGUF special-token id keys -> the tokenizer kwarg naming that token
_SPECIAL_TOKEN_KEYS = {
    "bos_token": "bos_token_id",
    "eos_token": "eos_token_id",
    "unk_token": "unknown_token_id",
    "pad_token": "padding_token_id",
}


def build_gguf_tokenizer(path: str | Path) -> PreTrainedTokenizerBase:
    """The tokenizer a GGUF's metadata describes, built from the cached parse.

    transformers' ``AutoTokenizer.from_pretrained(dir, gguf_file=...)`` takes ~4 s on SmolLM2
    because it also rebuilds the config with ``gguf.GGUFReader``. Its converters (which pick the
    right BPE / sentencepiece / unigram class, special tokens and split regex) are reused here
    on metadata we already hold, so the result is the same object in ~0.5 s.
    """
    gf = read_gguf(path)
    try:
        from transformers import PreTrainedTokenizerFast
        from transformers.integrations.gguf import GGUF_TOKENIZER_MAPPING, convert_gguf_tokenizer
    except ImportError:  # older transformers: no converter API on parsed metadata; slow path
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(str(gf.path.parent), gguf_file=gf.path.name)

    md = gf.metadata
    if "tokenizer.ggml.tokens" not in md:
        raise ValueError(
            f"{gf.path} has no tokenizer metadata (tokenizer.ggml.tokens); pass a "
            "tokenizer explicitly, e.g. tokenizer='HuggingFaceTB/SmolLM2-135M-Instruct'."
        )
    groups = {
        group: {
            hf: md[f"tokenizer.{key}"] for key, hf in renames.items() if f"tokenizer.{key}" in md
        }
        for group, renames in GGUF_TOKENIZER_MAPPING.items()
    }
    tokenizer_dict, init_kwargs = groups["tokenizer"], groups["tokenizer_config"]
    if tokenizer_dict.get("tokenizer_type") == "llama":
        # sentencepiece vocabularies add BOS unless the file says otherwise (llama.cpp's rule)
        init_kwargs.setdefault("add_bos_token", True)
    tokens = tokenizer_dict["tokens"]
    for kwarg, key in _SPECIAL_TOKEN_KEYS.items():
        token_id = md.get(f"tokenizer.ggml.{key}")
        init_kwargs[kwarg] = tokens[token_id] if token_id is not None else None
    backend, extra_kwargs = convert_gguf_tokenizer(gf.architecture, tokenizer_dict)
    return PreTrainedTokenizerFast(tokenizer_object=backend, **init_kwargs, **extra_kwargs)
