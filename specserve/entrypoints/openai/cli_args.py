"""Flags of the OpenAI-compatible server (``specserve serve`` and ``python -m
specserve.entrypoints.openai.api_server``): server flags here, engine flags from ``args.py``.

Names follow vLLM's where vLLM has the flag (``--api-key``, ``--served-model-name``,
``--chat-template``, ``--response-role``, ``--uvicorn-log-level``), both spellings accepted.
"""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass
from pathlib import Path

from specserve.entrypoints.args import (
    BoolFlag,
    add_engine_args,
    add_flag,
    parse_human_int,
)

API_KEY_ENV = "SPECSERVE_API_KEY"
DEFAULT_HOST = "127.0.0.1"
DEFAULT_PORT = 8000
# Sequences allowed to wait for a batch slot beyond --max-num-seqs before requests get 429.
DEFAULT_MAX_WAITING_SEQS = 1024
DEFAULT_MAX_REQUEST_BODY_BYTES = 8 * 2**20
DEFAULT_SHUTDOWN_TIMEOUT_S = 10.0
LOG_LEVELS = ("critical", "error", "warning", "info", "debug", "trace")


@dataclass(frozen=True)
class ServerConfig:
    host: str = DEFAULT_HOST
    port: int = DEFAULT_PORT
    api_key: str | None = None
    served_model_names: tuple[str, ...] = ()
    chat_template: str | None = None
    response_role: str = "assistant"
    max_waiting_seqs: int = DEFAULT_MAX_WAITING_SEQS
    max_request_body_bytes: int = DEFAULT_MAX_REQUEST_BODY_BYTES
    shutdown_timeout: float = DEFAULT_SHUTDOWN_TIMEOUT_S
    uvicorn_log_level: str = "info"
    access_log: bool = True


def add_server_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    g = parser.add_argument_group("server", "the HTTP server")
    add_flag(g, "host", default=DEFAULT_HOST,
             help=f"address to listen on (default: {DEFAULT_HOST}; 0.0.0.0 for all interfaces)")
    add_flag(g, "port", type=int, default=DEFAULT_PORT, help=f"port (default: {DEFAULT_PORT})")
    add_flag(g, "api_key", default=None, metavar="KEY",
             help=f"require 'Authorization: Bearer KEY' on /v1/* (default: env {API_KEY_ENV})")
    add_flag(g, "served_model_name", nargs="+", default=None, metavar="NAME",
             help="model name(s) clients use; the first is reported (default: --model)")
    add_flag(g, "chat_template", default=None, metavar="FILE_OR_TEMPLATE",
             help="Jinja chat template (a file or the template itself) replacing the model's")
    add_flag(g, "response_role", default="assistant", help="role of chat replies")
    add_flag(g, "max_waiting_seqs", type=int, default=DEFAULT_MAX_WAITING_SEQS,
             help="sequences that may wait beyond --max-num-seqs; more get 429 "
                  f"(default: {DEFAULT_MAX_WAITING_SEQS})")
    add_flag(g, "max_request_body_bytes", type=parse_human_int,
             default=DEFAULT_MAX_REQUEST_BODY_BYTES, metavar="BYTES",
             help=f"larger request bodies get 413 (default: {DEFAULT_MAX_REQUEST_BODY_BYTES})")
    add_flag(g, "shutdown_timeout", type=float, default=DEFAULT_SHUTDOWN_TIMEOUT_S,
             metavar="SECONDS", help="on SIGTERM, wait this long for in-flight requests, then "
             f"abort them (default: {DEFAULT_SHUTDOWN_TIMEOUT_S})")
    add_flag(g, "uvicorn_log_level", default="info", choices=LOG_LEVELS,
             help="uvicorn's log level (default: info)")
    add_flag(g, "disable_uvicorn_access_log", action=BoolFlag, default=False,
             help="do not log every HTTP request")
    add_flag(g, "disable_log_requests", action=BoolFlag, default=False,
             help="accepted for vLLM compatibility; requests are not logged anyway")
    add_flag(g, "disable_log_stats", action=BoolFlag, default=False,
             help="accepted for vLLM compatibility; no effect")
    return parser


def make_server_parser(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Server flags plus every engine flag (vLLM names, both spellings)."""
    add_server_args(parser)
    return add_engine_args(parser)


def load_chat_template(value: str | None) -> str | None:
    """A path to a template file, or the template text itself (vLLM accepts both)."""
    if value is None:
        return None
    path = Path(value).expanduser()
    if path.is_file():
        return path.read_text()
    if "{" in value:
        return value
    raise ValueError(f"--chat-template {value!r} is neither a file nor a Jinja template; give "
                     "the path of a .jinja file or the template text.")


def server_config_from_args(args: argparse.Namespace) -> ServerConfig:
    if args.port < 0 or args.port > 65535:
        raise ValueError(f"--port must be in [0, 65535], got {args.port}.")
    if args.max_waiting_seqs < 0:
        raise ValueError(f"--max-waiting-seqs must be >= 0, got {args.max_waiting_seqs}.")
    if args.max_request_body_bytes < 1:
        raise ValueError("--max-request-body-bytes must be positive, got "
                         f"{args.max_request_body_bytes}.")
    names = tuple(args.served_model_name or ())
    return ServerConfig(
        host=args.host, port=args.port,
        api_key=args.api_key or os.environ.get(API_KEY_ENV) or None,
        served_model_names=names,
        chat_template=load_chat_template(args.chat_template),
        response_role=args.response_role,
        max_waiting_seqs=args.max_waiting_seqs,
        max_request_body_bytes=args.max_request_body_bytes,
        shutdown_timeout=args.shutdown_timeout,
        uvicorn_log_level=args.uvicorn_log_level,
        access_log=not args.disable_uvicorn_access_log,
    )
