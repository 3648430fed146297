"""The ``specserve`` command: ``specserve generate --prompt "..."``, ``specserve serve [MODEL]``,
``specserve bench serve [flags]``.

Each subcommand registers itself with ``_add_<name>(subparsers)`` and sets ``handler``; ``main``
parses, dispatches, and turns the user's mistakes (``ValueError`` from the configs and
``SamplingParams``, ``NotImplementedError`` for features not built yet) into ``error: ...`` and
exit status 2, the same status argparse uses for bad flags, without a traceback.
"""

from __future__ import annotations

import argparse
import importlib
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from specserve.entrypoints.args import add_engine_args, add_flag, engine_kwargs_from_args

EXIT_USAGE = 2  # argparse's status for bad command lines; ours for bad values too
EXIT_INTERRUPTED = 130  # 128 + SIGINT, what shells report for Ctrl-C
DEFAULT_MAX_TOKENS = 64

Handler = Callable[[argparse.Namespace], int]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="specserve", allow_abbrev=False,
        description="LLM inference with lossless speculative decoding (vLLM-compatible flags).")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    _add_generate(subparsers)
    _add_serve(subparsers)
    _add_bench(subparsers)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``specserve`` script; returns the exit status."""
    parser = build_parser()
    args, unknown = parser.parse_known_args(argv)
    if unknown and not getattr(args, "forward_unknown", False):
        parser.error(f"unrecognized arguments: {' '.join(unknown)}")
    args.forwarded = unknown
    handler: Handler = args.handler
    try:
        return handler(args)
    except (ValueError, NotImplementedError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED


# ---------------------------------------------------------------------------------------------
# specserve generate


def _add_generate(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "generate", allow_abbrev=False, help="generate completions for prompts and print them",
        usage="specserve generate --prompt TEXT [--prompt TEXT ...] [options]",
        description="Generate a completion for each --prompt and print it; a one-line speed "
                    "summary goes to stderr.")
    sampling = parser.add_argument_group("prompts and sampling")
    add_flag(sampling, "prompt", action="append", required=True, metavar="TEXT",
             help="a prompt (repeat the flag for a batch)")
    add_flag(sampling, "chat", action=argparse.BooleanOptionalAction, default=None,
             help="send each prompt as a user message through the chat template (default: on "
                  "when the tokenizer has one; --no-chat sends the raw text)")
    add_flag(sampling, "max_tokens", type=int, default=DEFAULT_MAX_TOKENS,
             help=f"most tokens to generate per completion (default: {DEFAULT_MAX_TOKENS})")
    add_flag(sampling, "temperature", type=float, default=0.0,
             help="0 is greedy (default: 0)")
    add_flag(sampling, "top_p", type=float, help="nucleus sampling mass")
    add_flag(sampling, "top_k", type=int, help="sample from the k likeliest tokens")
    add_flag(sampling, "min_p", type=float, help="drop tokens below min_p * the top probability")
    add_flag(sampling, "n", type=int, help="completions per prompt (needs temperature > 0)")
    add_flag(sampling, "stop", action="append", metavar="TEXT",
             help="stop at this string (repeatable)")
    add_flag(sampling, "ignore_eos", action="store_true", help="keep going past end-of-sequence")
    add_engine_args(parser)
    parser.set_defaults(handler=_generate)


def _sampling_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    """SamplingParams keywords for the flags that were given (the rest keep their defaults)."""
    names = ("max_tokens", "temperature", "top_p", "top_k", "min_p", "n", "stop")
    kwargs = {name: getattr(args, name) for name in names if getattr(args, name) is not None}
    if args.ignore_eos:
        kwargs["ignore_eos"] = True
    return kwargs


def _generate(args: argparse.Namespace) -> int:
    from specserve import LLM, SamplingParams  # imported here: `--help` stays fast

    params = SamplingParams(**_sampling_kwargs(args))  # bad values fail before loading weights
    t0 = time.perf_counter()
    llm = LLM(**engine_kwargs_from_args(args))
    load_s = time.perf_counter() - t0
    chat = args.chat
    if chat is None:
        chat = bool(getattr(llm.get_tokenizer(), "chat_template", None))
    t1 = time.perf_counter()
    if chat:
        conversations = [[{"role": "user", "content": p}] for p in args.prompt]
        outputs = llm.chat(conversations, params, use_tqdm=False)
    else:
        outputs = llm.generate(args.prompt, params, use_tqdm=False)
    gen_s = time.perf_counter() - t1
    completions = [(i, c) for i, out in enumerate(outputs) for c in out.outputs]
    for i, completion in completions:
        if len(completions) > 1:
            suffix = f", completion {completion.index}" if params.n > 1 else ""
            print(f"--- prompt {i}{suffix} ---")
        print(completion.text, flush=True)
    num_tokens = sum(len(c.token_ids) for _, c in completions)
    print(f"{len(outputs)} prompt(s), {num_tokens} tokens in {gen_s:.2f}s "
          f"({num_tokens / max(gen_s, 1e-9):.1f} tok/s); model loaded in {load_s:.2f}s",
          file=sys.stderr)
    return 0


# ---------------------------------------------------------------------------------------------
# specserve serve


def _add_serve(subparsers: argparse._SubParsersAction) -> None:
    from specserve.entrypoints.openai.cli_args import make_server_parser

    parser = subparsers.add_parser(
        "serve", allow_abbrev=False, help="run the OpenAI-compatible HTTP server",
        usage="specserve serve [MODEL] [options]",
        description="Serve MODEL (or --model; default SmolLM2-135M-Instruct) over HTTP with "
                    "OpenAI's API: /v1/completions, /v1/chat/completions, /v1/models, /metrics.")
    parser.add_argument("model_tag", nargs="?", default=None, metavar="MODEL",
                        help="model to serve (same as --model)")
    make_server_parser(parser)
    parser.set_defaults(handler=_serve)


def _serve(args: argparse.Namespace) -> int:
    from specserve.entrypoints.openai.api_server import run_server

    if args.model_tag is not None:
        if args.model is not None and args.model != args.model_tag:
            raise ValueError(f"two models given: {args.model_tag!r} and --model {args.model!r}; "
                             "give one.")
        args.model = args.model_tag
    return run_server(args)


# ---------------------------------------------------------------------------------------------
# specserve bench serve

# The benchmark scripts live beside the package in a source checkout, not inside it.
BENCHMARKS_DIR = Path(__file__).resolve().parents[2] / "benchmarks"


def _add_bench(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "bench", allow_abbrev=False, help="benchmarks (from a source checkout)",
        description="Run a benchmark script from the checkout's benchmarks/ directory.")
    benches = parser.add_subparsers(dest="bench", metavar="BENCHMARK", required=True)
    serve = benches.add_parser(
        "serve", add_help=False, help="Poisson load against the server, with and without "
        "speculation (benchmarks/bench_serve.py; `specserve bench serve --help` for its flags)")
    serve.set_defaults(handler=_bench_serve, forward_unknown=True)  # its flags are the script's


def _bench_serve(args: argparse.Namespace) -> int:
    script = BENCHMARKS_DIR / "bench_serve.py"
    if not script.is_file():
        raise ValueError(f"`specserve bench serve` runs {script}, which only a source checkout "
                         "of specserve has; run it from a checkout (pip install -e .).")
    if str(BENCHMARKS_DIR) not in sys.path:  # as `python benchmarks/bench_serve.py` would
        sys.path.insert(0, str(BENCHMARKS_DIR))
    module = importlib.import_module("bench_serve")
    return module.main(args.forwarded)


if __name__ == "__main__":
    sys.exit(main())
