"""Engine configuration: frozen dataclasses validated once, at construction.

Every user-facing mistake becomes a ``ValueError`` that says what was given, what is allowed and
how to fix it, so that a bad ``LLM(...)`` call fails before any weights are loaded.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from specserve.model.layers.quantization import get_quantization_method
from specserve.model.layers.quantization.gguf_amx import PARTS_BY_PRECISION

FLOAT32_MATMUL_PRECISIONS = tuple(PARTS_BY_PRECISION)  # torch's: highest, high, medium

SUPPORTED_DTYPES: dict[str, torch.dtype | None] = {
    "auto": None,
    "float32": torch.float32,
    "float": torch.float32,
    "float16": torch.float16,
    "half": torch.float16,
    "bfloat16": torch.bfloat16,
}
SUPPORTED_DEVICES = ("auto", "cpu", "cuda")
DEFAULT_BLOCK_SIZE = 16
DEFAULT_MAX_NUM_SEQS = 256
# On CPU the KV cache is sized from a byte budget rather than a memory fraction.
DEFAULT_CPU_KV_CACHE_BYTES = 1 << 30


def _require(condition: bool, message: str) -> None:
    if not condition:
        raise ValueError(message)


def resolve_device(device: str) -> torch.device:
    """Map the user's device choice to a torch device ("auto" prefers CUDA when present)."""
    _require(
        device in SUPPORTED_DEVICES,
        f"device={device!r} is not supported; choose one of {list(SUPPORTED_DEVICES)}.",
    )
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device == "cuda" and not torch.cuda.is_available():
        raise ValueError("device='cuda' was requested but torch sees no CUDA device; use 'cpu'.")
    return torch.device(device)


def resolve_dtype(dtype: str | torch.dtype, config_dtype: torch.dtype | None,
                  device: torch.device) -> torch.dtype:
    """Pick the compute dtype.

    "auto" follows the checkpoint on CUDA (float32 checkpoints run in bfloat16 there, as in vLLM)
    and uses float32 on CPU, where it is the fastest exact path and matches the reference.
    """
    if isinstance(dtype, torch.dtype):
        _require(dtype in SUPPORTED_DTYPES.values(),
                 f"dtype={dtype} is not supported; choose one of {list(SUPPORTED_DTYPES)}.")
        return dtype
    _require(
        isinstance(dtype, str) and dtype in SUPPORTED_DTYPES,
        f"dtype={dtype!r} is not supported; choose one of {list(SUPPORTED_DTYPES)}.",
    )
    chosen = SUPPORTED_DTYPES[dtype]
    if chosen is not None:
        return chosen
    if device.type == "cpu":
        return torch.float32
    if config_dtype in (torch.float16, torch.bfloat16):
        return config_dtype
    return torch.bfloat16


@dataclass(frozen=True)
class CacheConfig:
    """Paged KV cache settings."""

    block_size: int = DEFAULT_BLOCK_SIZE
    gpu_memory_utilization: float = 0.9
    kv_cache_memory_bytes: int | None = None  # explicit budget (CPU default: 1 GiB)
    num_gpu_blocks_override: int | None = None  # exact block count, mainly for tests
    enable_prefix_caching: bool = True

    def __post_init__(self) -> None:
        _require(
            isinstance(self.block_size, int) and self.block_size in (1, 2, 4, 8, 16, 32, 64, 128),
            f"block_size={self.block_size!r} must be a power of two between 1 and 128.",
        )
        _require(
            isinstance(self.gpu_memory_utilization, (int, float))
            and 0.0 < self.gpu_memory_utilization <= 1.0,
            f"gpu_memory_utilization={self.gpu_memory_utilization!r} must be in (0, 1].",
        )
        _require(
            self.kv_cache_memory_bytes is None
            or (isinstance(self.kv_cache_memory_bytes, int) and self.kv_cache_memory_bytes > 0),
            f"kv_cache_memory_bytes={self.kv_cache_memory_bytes!r} must be a positive int.",
        )
        _require(
            self.num_gpu_blocks_override is None
            or (isinstance(self.num_gpu_blocks_override, int) and self.num_gpu_blocks_override > 0),
            f"num_gpu_blocks_override={self.num_gpu_blocks_override!r} must be a positive int.",
        )


@dataclass(frozen=True)
class SchedulerConfig:
    """Continuous batching limits."""

    max_num_seqs: int = DEFAULT_MAX_NUM_SEQS
    max_num_batched_tokens: int | None = None  # None: derived from max_model_len
    enable_chunked_prefill: bool = True
    # Plain greedy decode steps run this many forwards per scheduling round, feeding each
    # token back on the device (vLLM v0's multi-step scheduling); 1 = off.
    num_scheduler_steps: int = 1

    def __post_init__(self) -> None:
        _require(
            isinstance(self.num_scheduler_steps, int) and not isinstance(
                self.num_scheduler_steps, bool) and self.num_scheduler_steps >= 1,
            f"num_scheduler_steps={self.num_scheduler_steps!r} must be an int >= 1.",
        )
        _require(
            isinstance(self.max_num_seqs, int) and self.max_num_seqs >= 1,
            f"max_num_seqs={self.max_num_seqs!r} must be an int >= 1.",
        )
        _require(
            self.max_num_batched_tokens is None
            or (isinstance(self.max_num_batched_tokens, int) and self.max_num_batched_tokens >= 1),
            f"max_num_batched_tokens={self.max_num_batched_tokens!r} must be an int >= 1.",
        )


@dataclass(frozen=True)
class ParallelConfig:
    tensor_parallel_size: int = 1

    def __post_init__(self) -> None:
        _require(
            isinstance(self.tensor_parallel_size, int) and self.tensor_parallel_size >= 1,
            f"tensor_parallel_size={self.tensor_parallel_size!r} must be an int >= 1.",
        )
        if self.tensor_parallel_size != 1:
            raise NotImplementedError(
                f"tensor_parallel_size={self.tensor_parallel_size}: tensor parallelism is not "
                "implemented yet; use tensor_parallel_size=1."
            )


@dataclass(frozen=True)
class EngineArgs:
    """Everything the offline LLM and the server accept, before models are loaded."""

    model: str | None = None
    tokenizer: str | None = None
    dtype: str = "auto"
    seed: int = 0
    device: str = "auto"
    max_model_len: int | None = None
    enforce_eager: bool = False
    trust_remote_code: bool = False
    quantization: str | None = None  # a name in QUANTIZATION_METHODS
    # torch's float32 matmul precision while the models load (None: torch's current setting)
    float32_matmul_precision: str | None = None
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    speculative: Any = None  # SpeculativeConfig | None

    def __post_init__(self) -> None:
        _require(
            isinstance(self.seed, int) and not isinstance(self.seed, bool),
            f"seed={self.seed!r} must be an int.",
        )
        _require(
            self.max_model_len is None
            or (isinstance(self.max_model_len, int) and self.max_model_len >= 1),
            f"max_model_len={self.max_model_len!r} must be a positive int or None.",
        )
        _require(self.model is None or isinstance(self.model, str),
                 f"model={self.model!r} must be a string (path, Hub id or GGUF file).")
        if self.quantization is not None:
            get_quantization_method(self.quantization)  # unknown names fail here, before loading
        _require(self.float32_matmul_precision in (None, *FLOAT32_MATMUL_PRECISIONS),
                 f"float32_matmul_precision={self.float32_matmul_precision!r} must be one of "
                 f"{list(FLOAT32_MATMUL_PRECISIONS)} or None.")
