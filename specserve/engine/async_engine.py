"""AsyncLLMEngine: the same LLMEngine, stepped by a background loop while requests arrive.

Why one worker thread: ``LLMEngine`` is not thread-safe, and a step on CPU is long enough to
stall an event loop that must keep accepting connections. So every engine call (add, abort,
step, metrics, tokenizer use) runs on ONE dedicated thread, in submission order, and the event
loop only awaits the results. FIFO order is what makes abort-after-add and add-between-steps
correct without locks. Requests join the running batch at the next step (continuous batching).

Each request gets a :class:`RequestHandle`; outputs are cumulative, so the handle keeps only the
latest one: a slow reader sees merged progress instead of an ever-growing queue.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

from specserve.engine.llm_engine import LLMEngine
from specserve.outputs import CompletionOutput, RequestOutput
from specserve.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

T = TypeVar("T")
# Called on the event loop for every output of every request (metrics hook).
OutputObserver = Callable[["RequestHandle", RequestOutput, float], None]


class ServerOverloadedError(RuntimeError):
    """Admitting the request would exceed max_num_seqs + max_waiting_seqs (answer 429)."""


class EngineDeadError(RuntimeError):
    """The engine loop stopped or a step failed; the request cannot complete (answer 500/503)."""


class RequestHandle:
    """One engine request as the server sees it: an async iterator of cumulative outputs."""

    def __init__(self, owner: AsyncLLMEngine, request_id: str, num_seqs: int,
                 added: asyncio.Future[None]) -> None:
        self.owner = owner
        self.request_id = request_id
        self.num_seqs = num_seqs
        self.arrival_time = time.time()
        self.finished = False
        self.closed = False
        # Metrics bookkeeping, updated by the observer on the event loop.
        self.num_tokens_seen = 0
        self.last_token_time: float | None = None
        self._added = added
        self._latest: RequestOutput | None = None
        self._error: BaseException | None = None
        self._event = asyncio.Event()

    # ---- producer side (event loop, called by the engine loop) ----------------------------
    def _put(self, output: RequestOutput) -> None:
        self._latest = output
        self.finished = output.finished
        self._event.set()

    def _fail(self, exc: BaseException) -> None:
        self._error = exc
        self._event.set()

    # ---- consumer side ---------------------------------------------------------------------
    def __aiter__(self) -> RequestHandle:
        return self

    async def wait_added(self) -> None:
        """Wait until the engine holds the request; raises its ValueError for a bad prompt."""
        if self._added is not None:
            added, self._added = self._added, None
            await asyncio.shield(added)  # a cancelled reader must not unqueue a half-known add

    async def __anext__(self) -> RequestOutput:
        await self.wait_added()
        while True:
            if self._latest is not None:
                out, self._latest = self._latest, None
                return out
            if self._error is not None:
                raise self._error
            if self.finished or self.closed:
                self.close()
                raise StopAsyncIteration
            self._event.clear()
            await self._event.wait()

    def close(self) -> None:
        """Release the request: abort it in the engine if still running (idempotent)."""
        if self.closed:
            return
        self.closed = True
        self.owner._release(self)


class AsyncLLMEngine:
    """Drive an LLMEngine from a background task; admit requests up to a bounded queue."""

    def __init__(self, engine: LLMEngine, max_waiting_seqs: int | None = None,
                 observer: OutputObserver | None = None) -> None:
        self.engine = engine
        self.max_num_seqs = engine.args.scheduler.max_num_seqs
        self.max_waiting_seqs = max_waiting_seqs
        self.observer = observer
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="specserve-engine")
        self._handles: dict[str, RequestHandle] = {}
        self._num_seqs_in_flight = 0
        self._wake: asyncio.Event | None = None
        self._loop_task: asyncio.Task[None] | None = None
        self._stopping = False
        self.num_step_failures = 0

    # ---- properties the server needs --------------------------------------------------------
    @property
    def tokenizer(self):  # use only through run_sync (the tokenizer is not thread-safe)
        return self.engine.tokenizer

    @property
    def max_model_len(self) -> int:
        return self.engine.max_model_len

    @property
    def vocab_size(self) -> int:
        return self.engine.vocab_size

    @property
    def speculative(self) -> bool:
        return self.engine.args.speculative is not None

    @property
    def capacity(self) -> int | None:
        """Most sequences admitted at once (running + waiting), None when unbounded."""
        if self.max_waiting_seqs is None:
            return None
        return self.max_num_seqs + self.max_waiting_seqs

    @property
    def num_seqs_in_flight(self) -> int:
        return self._num_seqs_in_flight

    @property
    def is_running(self) -> bool:
        return self._loop_task is not None and not self._loop_task.done()

    # ---- lifecycle ---------------------------------------------------------------------------
    async def start(self) -> None:
        if self._loop_task is not None:
            return
        self._wake = asyncio.Event()
        self._loop_task = asyncio.create_task(self._run_loop(), name="specserve-engine-loop")

    async def shutdown(self) -> None:
        """Abort whatever is still in flight, stop the loop and the engine thread."""
        self._stopping = True
        for handle in list(self._handles.values()):
            handle._fail(EngineDeadError("the server is shutting down; the request was aborted."))
            handle.close()
        if self._loop_task is not None:
            self._loop_task.cancel()
            try:
                await self._loop_task
            except asyncio.CancelledError:
                pass
        self._executor.shutdown(wait=True, cancel_futures=False)

    async def run_sync(self, fn: Callable[..., T], *args: Any) -> T:
        """Run fn(*args) on the engine thread (after everything submitted before it)."""
        return await asyncio.get_running_loop().run_in_executor(self._executor, fn, *args)

    # ---- requests ----------------------------------------------------------------------------
    def check_capacity(self, num_seqs: int) -> None:
        """Raise ServerOverloadedError unless num_seqs more sequences fit the queue now."""
        if self._stopping or not self.is_running:
            raise EngineDeadError("the engine is not running (shutting down or failed).")
        cap = self.capacity
        if cap is not None and self._num_seqs_in_flight + num_seqs > cap:
            raise ServerOverloadedError(
                f"the server is at capacity: {self._num_seqs_in_flight} sequences are running or "
                f"waiting and this request adds {num_seqs}, but at most {cap} are admitted "
                f"(max_num_seqs={self.max_num_seqs} + max_waiting_seqs="
                f"{self.max_waiting_seqs}). Retry later.")

    def submit(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
               prompt: str | None = None) -> RequestHandle:
        """Admit and queue a request; synchronous, so that admission decisions never race.

        Errors the engine raises while adding (bad prompt) surface on the first iteration.
        """
        self.check_capacity(params.n)
        assert request_id not in self._handles, request_id
        loop = asyncio.get_running_loop()
        added = loop.run_in_executor(self._executor, self._add_sync, request_id, prompt,
                                     prompt_token_ids, params)
        handle = RequestHandle(self, request_id, params.n, added)
        self._handles[request_id] = handle
        self._num_seqs_in_flight += params.n
        added.add_done_callback(lambda f: self._on_added(handle, f))
        return handle

    def _add_sync(self, request_id: str, prompt: str | None, prompt_token_ids: list[int],
                  params: SamplingParams) -> None:
        self.engine.add_request(request_id, prompt, params, prompt_token_ids=prompt_token_ids)

    def _on_added(self, handle: RequestHandle, fut: asyncio.Future[None]) -> None:
        if fut.cancelled() or fut.exception() is not None:
            handle.finished = True  # nothing to abort in the engine
            handle.close()
        elif self._wake is not None:
            self._wake.set()

    def _release(self, handle: RequestHandle) -> None:
        if self._handles.pop(handle.request_id, None) is None:
            return
        self._num_seqs_in_flight -= handle.num_seqs
        if not handle.finished:
            # FIFO executor: runs after the add, so the request is found and its KV freed.
            try:
                self._executor.submit(self.engine.abort_request, handle.request_id)
            except RuntimeError:  # executor already shut down: the engine is going away
                pass

    # ---- the loop ----------------------------------------------------------------------------
    def _step_sync(self) -> tuple[list[RequestOutput], bool]:
        if not self.engine.has_unfinished_requests():
            return [], False
        outputs = self.engine.step()
        return [_snapshot(o) for o in outputs], self.engine.has_unfinished_requests()

    async def _run_loop(self) -> None:
        assert self._wake is not None
        while not self._stopping:
            await self._wake.wait()
            self._wake.clear()
            more = True
            while more and not self._stopping:
                try:
                    outputs, more = await self.run_sync(self._step_sync)
                except Exception as exc:  # an engine bug: fail what is in flight, keep serving
                    logger.exception("engine step failed; aborting %d in-flight requests",
                                     len(self._handles))
                    self.num_step_failures += 1
                    await self._fail_all(exc)
                    break
                now = time.time()
                for out in outputs:
                    self._dispatch(out, now)

    def _dispatch(self, out: RequestOutput, now: float) -> None:
        handle = self._handles.get(out.request_id)
        if handle is None:
            return  # aborted by its client while the step ran
        if self.observer is not None:
            try:
                self.observer(handle, out, now)
            except Exception:  # metrics must never break serving
                logger.exception("output observer failed")
        handle._put(out)

    async def _fail_all(self, exc: Exception) -> None:
        err = EngineDeadError(f"the engine failed while running this request: {exc!r}")
        ids = list(self._handles)
        for handle in list(self._handles.values()):
            handle._fail(err)
        try:
            await self.run_sync(lambda: [self.engine.abort_request(i) for i in ids])
        except Exception:
            logger.exception("aborting after a failed step failed too")

    # ---- engine-thread helpers ------------------------------------------------------------------
    async def get_metrics(self) -> dict[str, object]:
        return await self.run_sync(self.engine.get_metrics)

    async def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids as the engine would compute them for a text prompt."""
        tok = self.engine.tokenizer
        if add_special_tokens:
            return await self.run_sync(tok.encode, text)
        return await self.run_sync(lambda: tok.encode(text, add_special_tokens=False))

    async def decode(self, token_ids: list[int]) -> str:
        return await self.run_sync(self.engine.tokenizer.decode, token_ids)


def _snapshot(out: RequestOutput) -> RequestOutput:
    """Copy what the next step mutates in place (logprob lists, metrics), on the engine thread."""
    outputs = [
        CompletionOutput(
            index=c.index, text=c.text, token_ids=list(c.token_ids),
            cumulative_logprob=c.cumulative_logprob,
            logprobs=None if c.logprobs is None else list(c.logprobs[: len(c.token_ids)]),
            finish_reason=c.finish_reason, stop_reason=c.stop_reason)
        for c in out.outputs
    ]
    return RequestOutput(
        request_id=out.request_id, prompt=out.prompt,
        prompt_token_ids=list(out.prompt_token_ids or []),
        prompt_logprobs=None if out.prompt_logprobs is None else list(out.prompt_logprobs),
        outputs=outputs, finished=out.finished,
        metrics=None if out.metrics is None else dataclasses.replace(out.metrics))
