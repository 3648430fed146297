"""POST /v1/completions: prompts as text, token ids, or lists of either; streamed or not.

Choice ``index`` is ``prompt_index * n + completion_index``, as in OpenAI's API. With ``echo``
the prompt text (and, with ``logprobs``, its token logprobs) comes before the completion.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

from fastapi import Request
from fastapi.responses import Response, StreamingResponse
from starlette.background import BackgroundTask

from specserve.engine.async_engine import EngineDeadError, RequestHandle
from specserve.entrypoints.openai.errors import APIError, error_body
from specserve.entrypoints.openai.protocol import (
    CompletionChoice,
    CompletionLogprobs,
    CompletionRequest,
    CompletionResponse,
    random_id,
)
from specserve.entrypoints.openai.serving_engine import OpenAIServing, close_all
from specserve.entrypoints.openai.streaming import (
    DONE,
    ChoiceTracker,
    ClientDisconnected,
    merge,
    sse,
    unless_disconnected,
)
from specserve.outputs import Logprob, RequestOutput
from specserve.sampling_params import SamplingParams

CLIENT_CLOSED_REQUEST = 499  # nginx's status for a client that went away


class LogprobsBuilder:
    """OpenAI's legacy logprobs object (tokens, token_logprobs, top_logprobs, text_offset)."""

    def __init__(self, offset: int = 0) -> None:
        self.offset = offset

    def build(self, token_ids: list[int], entries: list[dict[int, Logprob] | None],
              token_texts: dict[int, str] | None = None,
              out: CompletionLogprobs | None = None) -> CompletionLogprobs:
        """Entries for token_ids, appended to out (a new object when None) and returned."""
        out = CompletionLogprobs() if out is None else out
        for tid, entry in zip(token_ids, entries, strict=False):
            if entry is None:  # the prompt's first token: nothing predicts it
                text, lp, top = (token_texts or {}).get(tid, ""), None, None
            else:
                chosen = entry[tid]
                text, lp = chosen.decoded_token or "", chosen.logprob
                top = {(e.decoded_token or ""): e.logprob
                       for e in sorted(entry.values(), key=lambda e: e.rank or 0)}
            out.tokens.append(text)
            out.token_logprobs.append(lp)
            out.top_logprobs.append(top)
            out.text_offset.append(self.offset)
            self.offset += len(text)
        return out


class OpenAIServingCompletion(OpenAIServing):
    async def create(self, req: CompletionRequest, raw: Request) -> Response:
        model = self.check_model(req.model)
        if req.suffix is not None:
            raise APIError(400, "suffix is not supported by this server.", param="suffix")
        prompts = _prompt_list(req.prompt)
        self.check_n_fits(req.n * len(prompts))
        echo_logprobs = req.logprobs if req.echo else None
        params = self.sampling_params(req, max_tokens=req.max_tokens, logprobs=req.logprobs,
                                      prompt_logprobs=echo_logprobs, best_of=req.best_of)
        token_ids, texts = [], []
        for prompt in prompts:
            ids = await self.engine.encode(prompt) if isinstance(prompt, str) else prompt
            self.check_token_ids(ids)
            self.check_context(len(ids), params.max_tokens)
            token_ids.append(ids)
            texts.append(prompt if isinstance(prompt, str) else None)
        echo_texts = None
        if req.echo:
            echo_texts = [t if t is not None else await self.engine.decode(ids)
                          for t, ids in zip(texts, token_ids, strict=True)]
        request_id = random_id("cmpl")
        handles = await self.submit(request_id, token_ids, params, texts)
        if req.stream:
            body = self._stream(request_id, model, handles, params, req, echo_texts)
            return StreamingResponse(body, media_type="text/event-stream",
                                     background=BackgroundTask(close_all, handles))
        try:
            gathered = asyncio.gather(*(self.final_outputs(h) for h in handles))
            outputs = await unless_disconnected(gathered, raw)
        except ClientDisconnected:
            return Response(status_code=CLIENT_CLOSED_REQUEST)
        finally:
            close_all(handles)
        return await self._response(request_id, model, outputs, params, req, echo_texts)

    async def _first_token_texts(self, outputs: list[RequestOutput]) -> dict[int, str]:
        ids = {o.prompt_token_ids[0] for o in outputs if o.prompt_token_ids}
        tok = self.engine.tokenizer
        return await self.engine.run_sync(lambda: {t: tok.decode([t]) for t in ids})

    async def _response(self, request_id: str, model: str, outputs: list[RequestOutput],
                        params: SamplingParams, req: CompletionRequest,
                        echo_texts: list[str] | None) -> CompletionResponse:
        first_texts = await self._first_token_texts(outputs) if req.echo else None
        choices = []
        for i, out in enumerate(outputs):
            for c in out.outputs:
                prefix = echo_texts[i] if echo_texts else ""
                logprobs = None
                if params.logprobs is not None:
                    builder = LogprobsBuilder()
                    logprobs = CompletionLogprobs()
                    if req.echo:
                        builder.build(out.prompt_token_ids, out.prompt_logprobs or [],
                                      first_texts, out=logprobs)
                    builder.build(list(c.token_ids), c.logprobs or [], out=logprobs)
                choices.append(CompletionChoice(
                    index=i * params.n + c.index, text=prefix + c.text, logprobs=logprobs,
                    finish_reason=c.finish_reason, stop_reason=c.stop_reason))
        return CompletionResponse(id=request_id, model=model, choices=choices,
                                  usage=self.usage(outputs),
                                  spec_decode_stats=self.spec_stats(outputs))

    async def _stream(self, request_id: str, model: str, handles: list[RequestHandle],
                      params: SamplingParams, req: CompletionRequest,
                      echo_texts: list[str] | None) -> AsyncIterator[str]:
        trackers: dict[int, ChoiceTracker] = {}
        builders: dict[int, LogprobsBuilder] = {}
        echoed: set[int] = set()
        latest: dict[int, RequestOutput] = {}
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        try:
            async for i, out in merge(handles):
                latest[i] = out
                for c in out.outputs:
                    index = i * params.n + c.index
                    tracker = trackers.setdefault(index, ChoiceTracker(params.stop))
                    delta = tracker.advance(c)
                    prefix = echo_texts[i] if echo_texts and index not in echoed else ""
                    if delta is None or not (delta.text or delta.finish_reason or prefix
                                             or params.logprobs is not None):
                        continue
                    echoed.add(index)
                    logprobs = None
                    if params.logprobs is not None:
                        builder = builders.setdefault(index, LogprobsBuilder())
                        logprobs = CompletionLogprobs()
                        if prefix:  # the echoed prompt's logprobs lead, as in vLLM
                            builder.build(out.prompt_token_ids, out.prompt_logprobs or [],
                                          await self._first_token_texts([out]), out=logprobs)
                        builder.build(delta.token_ids, delta.logprobs or [], out=logprobs)
                    chunk = CompletionResponse(id=request_id, model=model, choices=[
                        CompletionChoice(index=index, text=prefix + delta.text,
                                         logprobs=logprobs, finish_reason=delta.finish_reason,
                                         stop_reason=delta.stop_reason)])
                    if delta.finish_reason is not None:
                        chunk.spec_decode_stats = self.spec_stats(list(latest.values()))
                    yield sse(chunk)
            if include_usage:
                final = list(latest.values())
                yield sse(CompletionResponse(id=request_id, model=model, choices=[],
                                             usage=self.usage(final),
                                             spec_decode_stats=self.spec_stats(final)))
        except EngineDeadError as exc:
            yield sse(error_body(503, str(exc)))
        finally:
            close_all(handles)
        yield DONE


def _prompt_list(prompt: str | list[str] | list[int] | list[list[int]]) -> list:
    """One entry per prompt: a string or a list of token ids."""
    if isinstance(prompt, str):
        return [prompt]
    if not prompt:
        raise APIError(400, "prompt must not be empty: give a string, a list of strings, a list "
                       "of token ids or a list of such lists.", param="prompt")
    if isinstance(prompt[0], int):
        return [prompt]
    return list(prompt)
