"""Builders for tiny random Hugging Face checkpoints used by the test-suite.

Everything here is deterministic: building the same thing twice (in any process) writes the same
bytes. Nothing is downloaded; the tokenizer is trained on the small corpus embedded below.

Checkpoint layout (what `save_pretrained` writes on the Hub):

    config.json  model.safetensors  generation_config.json
    tokenizer.json  tokenizer_config.json (with the chat template)  special_tokens_map.json

The JSON files are rewritten in the layout most Hub checkpoints use rather than transformers-5's
(`rope_theta` + `rope_scaling` instead of `rope_parameters`, `torch_dtype` instead of `dtype`,
`tokenizer_class: PreTrainedTokenizerFast` and the chat template inside tokenizer_config.json),
so the engine's loader sees what real checkpoints contain; transformers 4.x and 5.x read them.

Tokenizer (byte-level BPE, no normaliser, so `decode(encode(s)) == s` for every string):

    id 0  "<|endoftext|>"  unk and pad
    id 1  "<|im_start|>"   bos (never added automatically, as in SmolLM2)
    id 2  "<|im_end|>"     eos (ends every chat turn)
    ids 3..258             the 256 byte tokens, then the learned merges (TOKENIZER_VOCAB_SIZE)

These are SmolLM2's ids and roles, except pad, which SmolLM2 sets to eos; keeping them apart
here catches code that confuses the two.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
UNK_TOKEN_ID = 0
PAD_TOKEN_ID = 0
BOS_TOKEN_ID = 1
EOS_TOKEN_ID = 2
# Total vocabulary of the tokenizer: 3 specials + 256 bytes + 141 merges.
TOKENIZER_VOCAB_SIZE = 400
# Model vocabularies are padded up to a multiple of this (rows past the tokenizer are unused).
VOCAB_MULTIPLE = 64
MAX_POSITION_EMBEDDINGS = 512
# Random init (see `_randomize`). HF's default (std 0.02, unit norms, zero biases) gives nearly
# uniform logits whose top-2 gap is within float noise, and zero biases that a loader could drop
# unnoticed. Matrices get N(0, INIT_STD); biases N(0, BIAS_STD); norm gains U(0.5, 1.5), and
# the final norm's gain is multiplied by LOGIT_SCALE so top-1 / top-2 logit gaps are of order 1.
INIT_STD = 0.2
BIAS_STD = 0.1
LOGIT_SCALE = 3.0

LLAMA_ROPE_THETA = 10000.0
QWEN2_ROPE_THETA = 1000000.0

SUPPORTED_ARCHS = ("llama", "opt", "qwen2")

# ChatML, like SmolLM2-Instruct's template minus its default system prompt.
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

LLAMA3_ROPE_SCALING = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 64,
}

_CORPUS = """\
The quick brown fox jumps over the lazy dog. The dog did not seem to mind at all.
Once upon a time there was a small village at the edge of a large forest. The people of the
village were farmers, and every morning they walked to their fields before the sun came up.
In the evening they would sit together and tell stories about the old days, when the river was
wide and the winters were long. Children listened to these stories and dreamed of adventure.
The future of artificial intelligence is difficult to predict, but many researchers believe that
language models will become faster, smaller and more useful. Speculative decoding is one of the
ideas that makes generation faster: a small draft model proposes tokens and a large target model
verifies them in a single forward pass. When the draft is right, several tokens are accepted at
once; when it is wrong, the target model corrects it, so the output is exactly the same.
What is the capital of France? The capital of France is Paris. What is the capital of Italy?
The capital of Italy is Rome. Where is the tallest mountain in the world? It is in the Himalayas.
Please write a short poem about the sea. The sea is blue, the sea is deep, the sea is where the
fishes sleep. Thank you for your help, and have a nice day. You are welcome!
The weather today is sunny with a light breeze from the west. Tomorrow there will be rain in the
morning and clouds in the afternoon. Remember to take an umbrella when you go out.
import numpy as np
import torch


def fibonacci(n: int) -> int:
    \"\"\"Return the n-th Fibonacci number.\"\"\"
    if n < 2:
        return n
    return fibonacci(n - 1) + fibonacci(n - 2)


class Counter:
    def __init__(self, start: int = 0) -> None:
        self.value = start

    def increment(self, step: int = 1) -> int:
        self.value += step
        return self.value


def main() -> None:
    for i in range(10):
        print(f"fib({i}) = {fibonacci(i)}")
    values = [x * x for x in range(100) if x % 2 == 0]
    print(sum(values), len(values))
    tensor = torch.zeros((4, 16), dtype=torch.float32)
    array = np.arange(16).reshape(4, 4)
    return None


if __name__ == "__main__":
    main()
#include <stdio.h>
int main(void) {
    for (int i = 0; i < 10; i++) {
        printf("%d\\n", i);
    }
    return 0;
}
function add(a, b) { return a + b; }
const result = add(1, 2);
console.log("result:", result);
SELECT name, count(*) FROM users WHERE age > 18 GROUP BY name ORDER BY name;
"""


def build_tokenizer(path: Path) -> None:
    """Train the byte-level BPE tokenizer and save it (with the chat template) under `path`."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=TOKENIZER_VOCAB_SIZE,
        min_frequency=2,
        show_progress=False,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(_CORPUS.splitlines(keepends=True), trainer=trainer)
    assert tok.get_vocab_size() == TOKENIZER_VOCAB_SIZE, tok.get_vocab_size()
    for token_id, token in enumerate(SPECIAL_TOKENS):
        assert tok.token_to_id(token) == token_id, (token, tok.token_to_id(token))

    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        unk_token=SPECIAL_TOKENS[UNK_TOKEN_ID],
        pad_token=SPECIAL_TOKENS[PAD_TOKEN_ID],
        bos_token=SPECIAL_TOKENS[BOS_TOKEN_ID],
        eos_token=SPECIAL_TOKENS[EOS_TOKEN_ID],
        model_max_length=MAX_POSITION_EMBEDDINGS,
        clean_up_tokenization_spaces=False,
        chat_template=CHAT_TEMPLATE,
    )
    fast.save_pretrained(str(path))
    _rewrite_tokenizer_config_hub_style(path)
    special_map = {
        "bos_token": SPECIAL_TOKENS[BOS_TOKEN_ID],
        "eos_token": SPECIAL_TOKENS[EOS_TOKEN_ID],
        "unk_token": SPECIAL_TOKENS[UNK_TOKEN_ID],
        "pad_token": SPECIAL_TOKENS[PAD_TOKEN_ID],
    }
    _write_json(path / "special_tokens_map.json", special_map)


def _rewrite_tokenizer_config_hub_style(path: Path) -> None:
    """Make tokenizer_config.json loadable by transformers 4.x as well as 5.x.

    transformers 5 writes `tokenizer_class: TokenizersBackend` and puts the template in
    chat_template.jinja; Hub checkpoints name PreTrainedTokenizerFast and embed the template.
    """
    config_path = path / "tokenizer_config.json"
    cfg = json.loads(config_path.read_text())
    cfg.pop("backend", None)
    cfg["tokenizer_class"] = "PreTrainedTokenizerFast"
    cfg["chat_template"] = CHAT_TEMPLATE
    (path / "chat_template.jinja").unlink(missing_ok=True)
    _write_json(config_path, cfg)


def tokenizer_length() -> int:
    """Number of tokens the tokenizer knows (specials included)."""
    return TOKENIZER_VOCAB_SIZE


def default_vocab_size() -> int:
    """The tokenizer's length rounded up to a multiple of VOCAB_MULTIPLE."""
    return -(-tokenizer_length() // VOCAB_MULTIPLE) * VOCAB_MULTIPLE


def _make_config(arch: str, *, num_layers: int, hidden_size: int, vocab_size: int,
                 dtype: torch.dtype, tie_word_embeddings: bool | None, overrides: dict):
    from transformers import LlamaConfig, OPTConfig, Qwen2Config

    common = dict(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        num_hidden_layers=num_layers,
        num_attention_heads=4,
        max_position_embeddings=MAX_POSITION_EMBEDDINGS,
        bos_token_id=BOS_TOKEN_ID,
        eos_token_id=EOS_TOKEN_ID,
        pad_token_id=PAD_TOKEN_ID,
        dtype=dtype,
    )
    if tie_word_embeddings is not None:
        common["tie_word_embeddings"] = tie_word_embeddings
    if arch == "opt":
        kwargs = dict(
            common,
            ffn_dim=2 * hidden_size,
            word_embed_proj_dim=hidden_size,
            do_layer_norm_before=True,
            init_std=INIT_STD,
        )
        kwargs.update(overrides)
        return OPTConfig(**kwargs)

    # Qwen2's real default (1e6) rather than 10000, so a loader that ignores rope_theta fails.
    default_theta = QWEN2_ROPE_THETA if arch == "qwen2" else LLAMA_ROPE_THETA
    rope_theta = overrides.pop("rope_theta", default_theta)
    rope_scaling = overrides.pop("rope_scaling", None)
    rope = dict(rope_scaling or {"rope_type": "default"}, rope_theta=rope_theta)
    kwargs = dict(
        common,
        num_key_value_heads=2,
        head_dim=hidden_size // 4,
        intermediate_size=2 * hidden_size,
        rope_parameters=rope,
        initializer_range=INIT_STD,
    )
    if arch == "qwen2":
        kwargs.setdefault("tie_word_embeddings", True)
        kwargs.update(rms_norm_eps=1e-6, use_sliding_window=False)
    kwargs.update(overrides)
    cls = LlamaConfig if arch == "llama" else Qwen2Config
    return cls(**kwargs)


def build_tiny_checkpoint(
    path: Path,
    arch: str,
    *,
    seed: int = 0,
    num_layers: int = 2,
    hidden_size: int = 64,
    vocab_size: int | None = None,
    dtype: torch.dtype = torch.float32,
    tie_word_embeddings: bool | None = None,
    **config_overrides,
) -> Path:
    """Write a tiny random `arch` checkpoint (model + tokenizer) under `path` and return `path`.

    Shapes: 4 attention heads (head_dim = hidden_size / 4), llama/qwen2 use 2 KV heads (GQA),
    MLP width 2 * hidden_size, 512 positions. Tied embeddings default to the architecture's
    usual choice: llama untied, qwen2 and opt tied. `config_overrides` go to the config class
    (`rope_scaling` / `rope_theta` are accepted in the Hub spelling for llama and qwen2).
    """
    from transformers import AutoModelForCausalLM, GenerationConfig

    if arch not in SUPPORTED_ARCHS:
        raise ValueError(f"arch={arch!r} is not supported; choose one of {SUPPORTED_ARCHS}")
    if hidden_size % 4:
        raise ValueError(f"hidden_size={hidden_size} must be a multiple of 4 (4 heads)")
    path = Path(path)
    if path.exists() and any(path.iterdir()):
        raise ValueError(f"{path} is not empty; build checkpoints into a new or empty folder")
    path.mkdir(parents=True, exist_ok=True)
    vocab_size = default_vocab_size() if vocab_size is None else vocab_size
    if vocab_size < tokenizer_length():
        raise ValueError(f"vocab_size={vocab_size} is smaller than the tokenizer "
                         f"({tokenizer_length()} tokens)")
    cfg = _make_config(arch, num_layers=num_layers, hidden_size=hidden_size,
                       vocab_size=vocab_size, dtype=dtype,
                       tie_word_embeddings=tie_word_embeddings,
                       overrides=dict(config_overrides))

    with torch.random.fork_rng(devices=[]):  # HF's own init draws from the global RNG
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    _randomize(model, seed)
    model = model.to(dtype).eval()
    model.generation_config = GenerationConfig(
        bos_token_id=BOS_TOKEN_ID, eos_token_id=EOS_TOKEN_ID, pad_token_id=PAD_TOKEN_ID)
    model.save_pretrained(str(path), safe_serialization=True)
    _rewrite_config_hub_style(path / "config.json")
    build_tokenizer(path)
    return path


@torch.no_grad()
def _randomize(model: torch.nn.Module, seed: int) -> None:
    """Re-draw every parameter (tied ones once) from a generator seeded with `seed`."""
    gen = torch.Generator().manual_seed(seed)
    final_norm = _final_norm_prefix(model)
    for name, param in model.named_parameters():
        if param.dim() >= 2:  # linear weights, token and position embeddings
            param.normal_(0.0, INIT_STD, generator=gen)
        elif name.endswith("bias"):
            param.normal_(0.0, BIAS_STD, generator=gen)
        else:  # RMSNorm / LayerNorm gain
            param.uniform_(0.5, 1.5, generator=gen)
            if name.startswith(final_norm):
                param.mul_(LOGIT_SCALE)


def _final_norm_prefix(model: torch.nn.Module) -> str:
    names = [n for n, _ in model.named_parameters()]
    for prefix in ("model.norm.", "model.decoder.final_layer_norm."):
        if any(n.startswith(prefix) for n in names):
            return prefix
    raise AssertionError(f"no final norm among {names}")


def _rewrite_config_hub_style(config_path: Path) -> None:
    """Respell transformers-5 keys the Hub way.

    `rope_parameters` -> `rope_theta` + `rope_scaling` (None for default rope); `dtype` ->
    `torch_dtype`.
    """
    cfg = json.loads(config_path.read_text())
    rope = cfg.pop("rope_parameters", None)
    if rope is not None:
        rope = dict(rope)
        cfg["rope_theta"] = rope.pop("rope_theta")
        cfg["rope_scaling"] = None if rope.get("rope_type") == "default" else rope
    if "dtype" in cfg:
        cfg["torch_dtype"] = cfg.pop("dtype")
    _write_json(config_path, cfg)


def _write_json(path: Path, obj: dict) -> None:
    path.write_text(json.dumps(obj, indent=2, sort_keys=True) + "\n")


# Prompts for engine tests: English and code, short to long. With the tiny tokenizer the last
# few are 60-120 tokens, so they span several 16-token KV blocks.
TEST_PROMPTS = (
    "Hello",
    "The future of AI is",
    "What is the capital of France?",
    "def fibonacci(n):",
    "Once upon a time there was a small village.",
    "import torch\nx = torch.zeros(4)\n",
    "Please write a short poem about the sea.",
    "SELECT name FROM users WHERE age > 18;",
    "Café au lait, naïve résumé, 日本語 and 🤖 are not ASCII.",
    "The weather today is sunny with a light breeze. Tomorrow there will be rain in the morning.",
    "class Counter:\n    def __init__(self, start: int = 0) -> None:\n        self.value = start\n",
    "Speculative decoding lets a small draft model propose several tokens that a large target "
    "model then verifies in one forward pass, so generation is faster but the output is the same.",
    "for (int i = 0; i < 10; i++) {\n    printf(\"%d\\n\", i);\n}\nreturn 0;\n"
    "function add(a, b) { return a + b; }\nconsole.log(add(1, 2));\n",
    "In the evening the people of the village would sit together and tell stories about the old "
    "days, when the river was wide and the winters were long, and the children listened to these "
    "stories and dreamed of adventure far beyond the edge of the forest.",
    "def main() -> None:\n    for i in range(10):\n        print(f\"fib({i}) = {fibonacci(i)}\")\n"
    "    values = [x * x for x in range(100) if x % 2 == 0]\n    print(sum(values))\n",
    "Language models will become faster, smaller and more useful. When the draft is right, many "
    "tokens are accepted at once; when it is wrong, the target model corrects it. Researchers "
    "measure the acceptance rate and the speed-up.",
)
