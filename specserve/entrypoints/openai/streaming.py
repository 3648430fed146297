"""Turning cumulative engine outputs into stream deltas, and the plumbing around streams.

The engine's text for a sequence only grows, except at the moment a stop string completes: then
it is cut back to where the stop string began. A stop string can span several steps (or
chunks), so the stream holds back any tail of the text that could still be the start of a stop
string; what it sends is therefore always a prefix of the final text, and the concatenated
deltas equal the non-streamed text exactly.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Awaitable, Sequence
from dataclasses import dataclass
from typing import TypeVar

from pydantic import BaseModel
from starlette.requests import Request

from specserve.outputs import CompletionOutput, Logprob

T = TypeVar("T")
DONE = "data: [DONE]\n\n"


def stop_holdback(text: str, stops: Sequence[str]) -> int:
    """Length of the longest tail of text that is a proper prefix of some stop string."""
    best = 0
    for stop in stops:
        for k in range(min(len(stop) - 1, len(text)), best, -1):
            if text.endswith(stop[:k]):
                best = k
                break
    return best


@dataclass
class Delta:
    text: str
    token_ids: list[int]
    logprobs: list[dict[int, Logprob]] | None
    finish_reason: str | None
    stop_reason: int | str | None


@dataclass
class ChoiceTracker:
    """What has been sent for one choice of a stream."""

    stops: Sequence[str]
    sent_chars: int = 0
    sent_tokens: int = 0
    done: bool = False

    def advance(self, c: CompletionOutput) -> Delta | None:
        """The part of c not sent yet, or None when there is nothing new to say."""
        if self.done:
            return None
        finished = c.finish_reason is not None
        end = len(c.text) if finished else len(c.text) - stop_holdback(c.text, self.stops)
        text = c.text[self.sent_chars:end] if end > self.sent_chars else ""
        token_ids = list(c.token_ids[self.sent_tokens:])
        logprobs = None if c.logprobs is None else list(c.logprobs[self.sent_tokens:])
        if not text and not token_ids and not finished:
            return None
        self.sent_chars = max(self.sent_chars, end)
        self.sent_tokens = len(c.token_ids)
        self.done = finished
        return Delta(text, token_ids, logprobs, c.finish_reason, c.stop_reason)


def sse(payload: BaseModel | dict) -> str:
    """One Server-Sent Event carrying a JSON payload."""
    if isinstance(payload, BaseModel):
        return f"data: {payload.model_dump_json()}\n\n"
    return f"data: {json.dumps(payload)}\n\n"


async def merge(iterators: Sequence[AsyncIterator[T]]) -> AsyncIterator[tuple[int, T]]:
    """Interleave several async iterators as items arrive, tagging each with its index."""
    if len(iterators) == 1:
        async for item in iterators[0]:
            yield 0, item
        return
    pending = {asyncio.ensure_future(anext(it)): i for i, it in enumerate(iterators)}
    try:
        while pending:
            done, _ = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
            for fut in done:
                i = pending.pop(fut)
                try:
                    item = fut.result()
                except StopAsyncIteration:
                    continue
                pending[asyncio.ensure_future(anext(iterators[i]))] = i
                yield i, item
    finally:
        for fut in pending:
            fut.cancel()


class ClientDisconnected(Exception):
    """The client went away before a non-streamed response was ready."""


async def _wait_disconnect(request: Request) -> None:
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


async def unless_disconnected(work: Awaitable[T], request: Request) -> T:
    """Await work, but cancel it (aborting its requests) if the client disconnects first.

    Streams need no such watch: Starlette cancels their body iterator on disconnect.
    """
    task = asyncio.ensure_future(work)
    watch = asyncio.ensure_future(_wait_disconnect(request))
    try:
        await asyncio.wait({task, watch}, return_when=asyncio.FIRST_COMPLETED)
    except asyncio.CancelledError:
        task.cancel()
        raise
    finally:
        watch.cancel()
    if task.done():
        return task.result()
    task.cancel()
    try:
        await task
    except (asyncio.CancelledError, Exception):
        pass
    raise ClientDisconnected
