"""POST /v1/chat/completions: messages rendered with the chat template, then generated.

The template comes from ``--chat-template`` or the tokenizer; the rendered prompt is tokenized
exactly as ``LLM.chat`` does, so greedy server output equals the offline API's.
"""

from __future__ import annotations

from collections.abc import AsyncIterator

from fastapi import Request
from fastapi.responses import Response, StreamingResponse
from starlette.background import BackgroundTask

from specserve.engine.async_engine import EngineDeadError, RequestHandle
from specserve.entrypoints.openai.errors import APIError, error_body
from specserve.entrypoints.openai.protocol import (
    ChatChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatLogprobEntry,
    ChatLogprobs,
    ChatLogprobTop,
    ChatResponseMessage,
    ChatStreamChoice,
    DeltaMessage,
    random_id,
)
from specserve.entrypoints.openai.serving_completion import CLIENT_CLOSED_REQUEST
from specserve.entrypoints.openai.serving_engine import OpenAIServing, close_all
from specserve.entrypoints.openai.streaming import (
    DONE,
    ChoiceTracker,
    ClientDisconnected,
    unless_disconnected,
)
from specserve.entrypoints.openai.streaming import sse as to_sse
from specserve.outputs import Logprob, RequestOutput
from specserve.sampling_params import SamplingParams


def chat_logprobs(token_ids: list[int], entries: list[dict[int, Logprob]],
                  num_top: int) -> ChatLogprobs:
    """OpenAI's chat logprobs: per token, its logprob and the num_top likeliest alternatives."""
    content = []
    for tid, entry in zip(token_ids, entries, strict=False):
        chosen = entry[tid]
        ranked = sorted((e for e in entry.values() if e.rank is not None and e.rank <= num_top),
                        key=lambda e: e.rank)
        content.append(ChatLogprobEntry(
            token=chosen.decoded_token or "", logprob=chosen.logprob,
            bytes=list((chosen.decoded_token or "").encode()),
            top_logprobs=[ChatLogprobTop(token=e.decoded_token or "", logprob=e.logprob,
                                         bytes=list((e.decoded_token or "").encode()))
                          for e in ranked]))
    return ChatLogprobs(content=content)


class OpenAIServingChat(OpenAIServing):
    async def create(self, req: ChatCompletionRequest, raw: Request) -> Response:
        model = self.check_model(req.model)
        self.check_n_fits(req.n)
        if req.top_logprobs is not None and not req.logprobs:
            raise APIError(400, "top_logprobs needs logprobs set to true.", param="top_logprobs")
        max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None \
            else req.max_tokens
        num_logprobs = (req.top_logprobs or 0) if req.logprobs else None
        params = self.sampling_params(req, max_tokens=max_tokens, logprobs=num_logprobs)
        prompt = await self.render_chat(req.messages, bool(req.add_generation_prompt))
        token_ids = await self.engine.encode(prompt)
        self.check_context(len(token_ids), params.max_tokens, param="messages")
        request_id = random_id("chatcmpl")
        handles = await self.submit(request_id, [token_ids], params, [prompt])
        if req.stream:
            include_usage = bool(req.stream_options and req.stream_options.include_usage)
            body = self._stream(request_id, model, handles[0], params, include_usage)
            return StreamingResponse(body, media_type="text/event-stream",
                                     background=BackgroundTask(close_all, handles))
        try:
            out = await unless_disconnected(self.final_outputs(handles[0]), raw)
        except ClientDisconnected:
            return Response(status_code=CLIENT_CLOSED_REQUEST)
        finally:
            close_all(handles)
        choices = [ChatChoice(
            index=c.index,
            message=ChatResponseMessage(role=self.config.response_role, content=c.text),
            logprobs=None if params.logprobs is None else chat_logprobs(
                list(c.token_ids), c.logprobs or [], params.logprobs),
            finish_reason=c.finish_reason, stop_reason=c.stop_reason) for c in out.outputs]
        return ChatCompletionResponse(id=request_id, model=model, choices=choices,
                                      usage=self.usage([out]),
                                      spec_decode_stats=self.spec_stats([out]))

    async def _stream(self, request_id: str, model: str, handle: RequestHandle,
                      params: SamplingParams, include_usage: bool) -> AsyncIterator[str]:
        def chunk(choices: list[ChatStreamChoice], **extra) -> str:
            return to_sse(ChatCompletionChunk(id=request_id, model=model, choices=choices,
                                              **extra))

        trackers = [ChoiceTracker(params.stop) for _ in range(params.n)]
        last: RequestOutput | None = None
        try:
            role = DeltaMessage(role=self.config.response_role, content="")
            yield chunk([ChatStreamChoice(index=i, delta=role) for i in range(params.n)])
            async for out in handle:
                last = out
                for c in out.outputs:
                    delta = trackers[c.index].advance(c)
                    if delta is None or not (delta.text or delta.finish_reason
                                             or params.logprobs is not None):
                        continue
                    logprobs = None if params.logprobs is None else chat_logprobs(
                        delta.token_ids, delta.logprobs or [], params.logprobs)
                    extra = {}
                    if delta.finish_reason is not None:
                        extra["spec_decode_stats"] = self.spec_stats([out])
                    yield chunk([ChatStreamChoice(
                        index=c.index, delta=DeltaMessage(content=delta.text),
                        logprobs=logprobs, finish_reason=delta.finish_reason,
                        stop_reason=delta.stop_reason)], **extra)
                if out.finished:
                    break
            if include_usage and last is not None:
                yield chunk([], usage=self.usage([last]),
                            spec_decode_stats=self.spec_stats([last]))
        except EngineDeadError as exc:
            yield to_sse(error_body(503, str(exc)))
        finally:
            close_all([handle])
        yield DONE
