"""AsyncEngine: the engine as an asyncio API (submit -> async stream of token events; abort; stats).

A driver of ``EngineCore`` on one dedicated thread (PyTorch releases the GIL inside its kernels, so
the event loop stays responsive). Requests are validated and tokenized in the caller's task, handed
to the loop thread as engine messages through a queue, and their events come back through
per-request asyncio queues. A consumer that stops iterating (client gone, task cancelled) aborts its
request, which frees its KV blocks at the next step boundary.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import queue
import threading
from collections.abc import AsyncIterator
from dataclasses import dataclass

from sits.engine.config import EngineConfig
from sits.engine.core import EngineCore
from sits.engine.errors import DuplicateRequestError, EngineDeadError, RequestAbortedError, SitsError
from sits.engine.llm_engine import LLMEngine
from sits.engine.messages import (AbortRequest, AdaptersChanged, EngineInput, EngineOutput, EngineRequest,
                                  EngineStats, LoadAdapter, RequestError, StepOutput, TokenEvent, UnloadAdapter)
from sits.engine.sampling_params import SamplingParams

log = logging.getLogger("sits.engine")
PENDING_POLL_S = 0.005     # while an adapter is read off the step thread, how often an idle loop looks


async def events_until_finished(queue: asyncio.Queue) -> AsyncIterator[TokenEvent]:
    """A request's token events from its queue, until (and including) the finished one; an exception
    put on the queue (the request failed, or its engine died) is raised."""
    while True:
        item = await queue.get()
        if isinstance(item, BaseException):
            raise item
        yield item
        if item.finished:
            return


class AdapterCalls:
    """LoRA adapters loaded into an engine through its driver: the engine reads the folder between two
    steps and answers with the adapters it serves now (``_call`` sends a message and awaits that)."""

    adapters: list[dict]

    async def load_adapter(self, name: str, path: str) -> list[dict]:
        self.adapters = await self._call(lambda rid: LoadAdapter(rid, name, path))
        return self.adapters

    async def unload_adapter(self, name: str) -> list[dict]:
        self.adapters = await self._call(lambda rid: UnloadAdapter(rid, name))
        return self.adapters


@dataclass(slots=True)
class _Stream:
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue


class AsyncEngine(AdapterCalls):
    def __init__(self, engine: LLMEngine):
        self.engine = engine
        self.core = EngineCore(engine)
        self._inputs: queue.SimpleQueue[EngineInput] = queue.SimpleQueue()
        self._streams: dict[str, _Stream] = {}
        self._wake = threading.Event()
        self._stopping = False
        self._dead: BaseException | None = None
        self._calls: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Future]] = {}
        self._call_ids = itertools.count()
        self.adapters: list[dict] = engine.adapter_views()      # the LoRA adapters served now
        self._thread = threading.Thread(target=self._loop, name="sits-engine", daemon=True)
        self._thread.start()

    @classmethod
    async def start(cls, cfg: EngineConfig) -> "AsyncEngine":
        """Build the engine (load, allocate, warm up) off the event loop, then start the step thread."""
        engine = await asyncio.to_thread(LLMEngine, cfg)
        return cls(engine)

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    # -- public API -----------------------------------------------------------------------------
    def prepare(self, prompt: str | list[int], params: SamplingParams | None = None, *,
                request_id: str | None = None, priority: int = 0, interactive: bool = True,
                add_special_tokens: bool = True, lora: str | None = None) -> EngineRequest:
        """Validate and tokenize a request without queueing it (raises the typed SitsError)."""
        if self._dead is not None:
            raise EngineDeadError(f"the engine loop has died: {self._dead!r}")
        req = self.engine.make_request(prompt, params, request_id=request_id, priority=priority,
                                       interactive=interactive, add_special_tokens=add_special_tokens, lora=lora)
        if req.request_id in self._streams:
            raise DuplicateRequestError(f"request id {req.request_id!r} is already in use",
                                        param="request_id")
        return req

    async def stream(self, req: EngineRequest) -> AsyncIterator[TokenEvent]:
        """Queue a prepared request; yield its token events until (and including) the finished one."""
        if req.request_id in self._streams:
            raise DuplicateRequestError(f"request id {req.request_id!r} is already in use",
                                        param="request_id")
        stream = _Stream(asyncio.get_running_loop(), asyncio.Queue())
        self._streams[req.request_id] = stream
        self._send(req)
        finished = False
        try:
            async for ev in events_until_finished(stream.queue):
                yield ev
                finished = ev.finished
        finally:
            if self._streams.get(req.request_id) is stream:
                del self._streams[req.request_id]
            if not finished:
                self._send(AbortRequest(req.request_id))

    async def generate(self, prompt: str | list[int], params: SamplingParams | None = None, *,
                       request_id: str | None = None, priority: int = 0,
                       interactive: bool = True) -> AsyncIterator[TokenEvent]:
        """Yield this request's token events until (and including) the finished one.

        Raises the typed SitsError for invalid input before anything is queued.
        """
        req = self.prepare(prompt, params, request_id=request_id, priority=priority, interactive=interactive)
        async for ev in self.stream(req):
            yield ev

    def abort(self, request_id: str, error: SitsError | None = None) -> None:
        """Stop a request now; its consumer gets ``error`` (default: RequestAbortedError)."""
        self._send(AbortRequest(request_id))
        stream = self._streams.pop(request_id, None)
        if stream is not None:
            stream.loop.call_soon_threadsafe(
                stream.queue.put_nowait, error or RequestAbortedError(f"request {request_id} was aborted"))

    def stats(self) -> EngineStats:
        return self.engine.stats()

    async def _call(self, message):
        if self._dead is not None:
            raise EngineDeadError(f"the engine loop has died: {self._dead!r}")
        rid = f"call-{next(self._call_ids)}"
        loop = asyncio.get_running_loop()
        fut = loop.create_future()
        self._calls[rid] = (loop, fut)
        try:
            self._send(message(rid))
            return await fut
        finally:
            self._calls.pop(rid, None)

    def _answer(self, request_id: str, result=None, error: BaseException | None = None) -> bool:
        """Resolve a call's future from the loop thread; False if ``request_id`` is no call."""
        call = self._calls.get(request_id)
        if call is None:
            return False
        loop, fut = call

        def resolve() -> None:
            if not fut.done():
                fut.set_exception(error) if error is not None else fut.set_result(result)
        loop.call_soon_threadsafe(resolve)
        return True

    @property
    def alive(self) -> bool:
        """The step thread is running and has not died."""
        return self._dead is None and not self._stopping and self._thread.is_alive()

    async def shutdown(self) -> None:
        self._stopping = True
        self._wake.set()
        await asyncio.to_thread(self._thread.join, 10)

    # -- the loop thread ------------------------------------------------------------------------
    def _send(self, msg: EngineInput) -> None:
        self._inputs.put(msg)
        self._wake.set()

    def _deliver(self, request_id: str, item) -> None:
        stream = self._streams.get(request_id)
        if stream is not None:
            stream.loop.call_soon_threadsafe(stream.queue.put_nowait, item)

    def _output(self, out: EngineOutput) -> None:
        if isinstance(out, StepOutput):
            for ev in out.events:
                self._deliver(ev.request_id, ev)
            for err in out.errors:
                self._deliver(err.request_id, err.to_exception())
        elif isinstance(out, AdaptersChanged):
            self._answer(out.request_id, out.adapters)
        elif isinstance(out, RequestError):
            if not self._answer(out.request_id, error=out.to_exception()):
                self._deliver(out.request_id, out.to_exception())

    def _loop(self) -> None:
        core = self.core
        try:
            while not self._stopping:
                while True:
                    try:
                        msg = self._inputs.get_nowait()
                    except queue.Empty:
                        break
                    for out in core.handle(msg):
                        self._output(out)
                for out in core.finished_work():
                    self._output(out)
                if not core.has_unfinished:
                    if core.idle_work():
                        continue
                    self._wake.wait(PENDING_POLL_S if core.pending else 0.5)
                    self._wake.clear()
                    continue
                self._output(core.step())
        except BaseException as e:  # a bug or a device error: fail every stream, loudly
            log.exception("engine loop died")
            self._dead = e
            err = EngineDeadError(f"the engine loop has died: {e!r}")
            for rid in list(self._streams):
                self._deliver(rid, err)
            for rid in list(self._calls):
                self._answer(rid, error=err)
        finally:
            core.close()
            for rid in list(self._calls):      # shut down with a call unanswered (an adapter still being read)
                self._answer(rid, error=EngineDeadError("the engine shut down before it answered"))
