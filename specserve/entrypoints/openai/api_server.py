"""The OpenAI-compatible HTTP server: FastAPI app factory and ``main``.

    python -m specserve.entrypoints.openai.api_server --model M [--speculative_model D ...]
    specserve serve M [flags]

The engine loads before the port opens, so a client that can connect can be served. SIGTERM
(uvicorn's handler) stops accepting connections, lets in-flight requests finish for
``--shutdown-timeout`` seconds, then the lifespan hook aborts what is left and frees its KV.
"""

from __future__ import annotations

import argparse
import logging
import signal
import sys
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import Response

from specserve import __version__
from specserve.engine.async_engine import AsyncLLMEngine, ServerOverloadedError
from specserve.engine.heap import freeze_startup_heap
from specserve.engine.llm_engine import LLMEngine
from specserve.entrypoints.args import engine_kwargs_from_args
from specserve.entrypoints.openai.cli_args import (
    ServerConfig,
    make_server_parser,
    server_config_from_args,
)
from specserve.entrypoints.openai.errors import APIError, error_response, install_error_handlers
from specserve.entrypoints.openai.metrics import METRICS_CONTENT_TYPE, ServerMetrics
from specserve.entrypoints.openai.middleware import LimitsMiddleware
from specserve.entrypoints.openai.protocol import (
    ChatCompletionRequest,
    ChatCompletionResponse,
    CompletionRequest,
    CompletionResponse,
    DetokenizeRequest,
    DetokenizeResponse,
    ErrorResponse,
    ModelCard,
    ModelList,
    TokenizeRequest,
    TokenizeResponse,
    VersionResponse,
)
from specserve.entrypoints.openai.serving_chat import OpenAIServingChat
from specserve.entrypoints.openai.serving_completion import OpenAIServingCompletion
from specserve.entrypoints.openai.serving_engine import OpenAIServing, ServingConfig

logger = logging.getLogger("specserve.server")

EXIT_USAGE = 2
_ERRORS: dict[int | str, dict[str, Any]] = {
    status: {"model": ErrorResponse} for status in (400, 401, 404, 413, 429, 503)}


def default_model_name(engine: LLMEngine, model_arg: str | None) -> str:
    return model_arg if model_arg else engine.source.name


def build_app(engine: AsyncLLMEngine, config: ServerConfig, model_path: str) -> FastAPI:
    """The app around an (unstarted) async engine; the lifespan starts and stops its loop."""
    names = config.served_model_names or (model_path,)
    serving_config = ServingConfig(served_model_names=names, model_path=model_path,
                                   chat_template=config.chat_template,
                                   response_role=config.response_role)
    completions = OpenAIServingCompletion(engine, serving_config)
    chats = OpenAIServingChat(engine, serving_config)
    base = OpenAIServing(engine, serving_config)
    metrics = ServerMetrics(engine, names[0])
    engine.observer = metrics.observe_output

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        await engine.start()
        yield
        await engine.shutdown()

    app = FastAPI(title="specserve", version=__version__, lifespan=lifespan,
                  description="OpenAI-compatible API with lossless speculative decoding.")
    install_error_handlers(app)

    async def on_overloaded(_: Request, exc: ServerOverloadedError) -> Response:
        metrics.rejected.labels(names[0]).inc()
        return error_response(APIError(429, str(exc), code="queue_full"),
                              headers={"Retry-After": "1"})

    app.add_exception_handler(ServerOverloadedError, on_overloaded)
    app.add_middleware(LimitsMiddleware, api_key=config.api_key,
                       max_body_bytes=config.max_request_body_bytes)

    @app.post("/v1/completions", response_model=CompletionResponse, responses=_ERRORS)
    async def create_completion(request: CompletionRequest, raw_request: Request):
        return await completions.create(request, raw_request)

    @app.post("/v1/chat/completions", response_model=ChatCompletionResponse,
              responses=_ERRORS)
    async def create_chat_completion(request: ChatCompletionRequest, raw_request: Request):
        return await chats.create(request, raw_request)

    @app.get("/v1/models", response_model=ModelList, responses=_ERRORS)
    async def list_models() -> ModelList:
        return ModelList(data=[ModelCard(id=name, root=model_path,
                                         max_model_len=engine.max_model_len)
                               for name in names])

    @app.get("/health", responses=_ERRORS)
    async def health() -> Response:
        if not engine.is_running:
            raise APIError(503, "the engine loop is not running.")
        return Response(status_code=200)

    @app.get("/version", response_model=VersionResponse)
    async def version() -> VersionResponse:
        return VersionResponse(version=__version__)

    @app.post("/tokenize", response_model=TokenizeResponse, responses=_ERRORS)
    async def tokenize(request: TokenizeRequest) -> TokenizeResponse:
        base.check_model(request.model)
        if (request.prompt is None) == (request.messages is None):
            raise APIError(400, "give exactly one of prompt (text) or messages (chat).",
                           param="prompt")
        text = request.prompt
        if request.messages is not None:
            if not request.messages:
                raise APIError(400, "messages must not be empty.", param="messages")
            text = await base.render_chat(request.messages,
                                          bool(request.add_generation_prompt))
        add_special = request.add_special_tokens is not False
        ids = await engine.encode(text, add_special_tokens=add_special)
        return TokenizeResponse(count=len(ids), max_model_len=engine.max_model_len, tokens=ids)

    @app.post("/detokenize", response_model=DetokenizeResponse, responses=_ERRORS)
    async def detokenize(request: DetokenizeRequest) -> DetokenizeResponse:
        base.check_model(request.model)
        bad = [t for t in request.tokens if not 0 <= t < engine.vocab_size]
        if bad:
            raise APIError(400, f"tokens {bad[:5]} are outside the vocabulary "
                           f"[0, {engine.vocab_size}).", param="tokens")
        return DetokenizeResponse(prompt=await engine.decode(request.tokens))

    @app.get("/metrics")
    async def prometheus_metrics() -> Response:
        return Response(content=await metrics.render(), media_type=METRICS_CONTENT_TYPE)

    return app


def create_engine(args: argparse.Namespace, config: ServerConfig) -> AsyncLLMEngine:
    """Load the model with the same keyword mapping as ``LLM(...)`` (one source of truth)."""
    from specserve.llm import LLM

    engine = LLM(**engine_kwargs_from_args(args)).llm_engine
    return AsyncLLMEngine(engine, max_waiting_seqs=config.max_waiting_seqs)


def run_server(args: argparse.Namespace) -> int:
    """Load the engine, then serve until SIGINT/SIGTERM. Returns the exit status."""
    import uvicorn

    config = server_config_from_args(args)  # bad server flags fail before weights load
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    engine = create_engine(args, config)
    frozen = freeze_startup_heap()  # full GC passes skip the loaded engine (engine/heap.py)
    logger.info("froze %d start-up objects out of the garbage collector's scans", frozen)
    model_path = default_model_name(engine.engine, args.model)
    app = build_app(engine, config, model_path)
    logger.info("serving %s on http://%s:%d (speculation: %s)", model_path, config.host,
                config.port, engine.speculative)
    server = uvicorn.Server(uvicorn.Config(
        app, host=config.host, port=config.port, log_level=config.uvicorn_log_level,
        access_log=config.access_log, timeout_graceful_shutdown=config.shutdown_timeout))
    # uvicorn handles SIGTERM (graceful drain), then re-raises it to the handler that was
    # installed before it: make that one a no-op, so a clean drain exits with status 0.
    signal.signal(signal.SIGTERM, lambda *_: logger.info("shut down after SIGTERM"))
    server.run()
    return 0 if server.started else 1


def make_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m specserve.entrypoints.openai.api_server", allow_abbrev=False,
        description="OpenAI-compatible server with lossless speculative decoding.")
    return make_server_parser(parser)


def main(argv: Sequence[str] | None = None) -> int:
    args = make_parser().parse_args(argv)
    try:
        return run_server(args)
    except (ValueError, NotImplementedError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_USAGE


if __name__ == "__main__":
    sys.exit(main())
