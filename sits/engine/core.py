"""EngineCore: one engine driven by typed messages (``sits.engine.messages``).

A driver owns the thread the core runs on and moves messages in and outputs out; the core does
everything else. ``AsyncEngine`` is a driver on a thread of the caller's process; an instance
process (``sits.runtime.instance_worker``) is a driver behind a socket. Both loop the same way:
``handle`` each input as it arrives, ``step`` while ``has_unfinished``, ``idle_work`` otherwise, and
send what ``finished_work`` returns (answers to work done off the step thread). A LoRA adapter's
folder is read on a thread of its own, so a large one never stalls the running streams; it is
served between two steps once read (``pending``: the driver polls for it meanwhile).
"""

from __future__ import annotations

import time
from concurrent.futures import Future, ThreadPoolExecutor

from sits.engine.errors import SitsError
from sits.engine.llm_engine import LLMEngine
from sits.engine.lora import AdapterExistsError
from sits.engine.messages import (AbortRequest, AdaptersChanged, EmbedRequest, Embedded, EngineInput, EngineOutput,
                                  EngineRequest, EngineStats, FaultDirectives, LoadAdapter, Ping, Pong, RequestError,
                                  StepOutput, UnloadAdapter)


class EngineCore:
    def __init__(self, engine: LLMEngine):
        self.engine = engine
        self._faults = FaultDirectives()
        self._faults_since = 0.0
        self._dropped_ping: int | None = None     # answered once pings resume (the front end asks only once)
        self._reads: dict[str, tuple[LoadAdapter, Future]] = {}   # adapter folders being read, by request id
        self._reader: ThreadPoolExecutor | None = None

    @property
    def has_unfinished(self) -> bool:
        return self.engine.has_unfinished

    @property
    def pending(self) -> bool:
        """Work under way off the step thread (an adapter being read): ``finished_work`` will answer it."""
        return bool(self._reads)

    @property
    def busy(self) -> bool:
        """Work to do without waiting for input: requests to step, a KV pool still to fault in, or
        decode graphs still to capture."""
        graphs = self.engine.runner.graphs
        return (self.engine.has_unfinished or not self.engine.kv_cache.fully_touched
                or (graphs is not None and graphs.pending))

    def handle(self, msg: EngineInput) -> list[EngineOutput]:
        """Apply one input; what it answers at once (an error, embeddings, a pong)."""
        if isinstance(msg, EngineRequest):
            try:
                self.engine.add(msg)
            except SitsError as e:
                return [RequestError.of(msg.request_id, e)]
        elif isinstance(msg, AbortRequest):
            self.engine.abort(msg.request_id)
        elif isinstance(msg, EmbedRequest):         # between steps: the model is this core's alone
            try:
                return [Embedded(msg.request_id, self.engine.embed(msg.inputs))]
            except SitsError as e:
                return [RequestError.of(msg.request_id, e)]
        elif isinstance(msg, LoadAdapter):       # read off the step thread; served between steps once read
            try:
                if self.engine.adapters is not None:
                    self.engine.adapters.check_new(msg.name)
                    if any(m.name == msg.name for m, _ in self._reads.values()):
                        raise AdapterExistsError(f"adapter {msg.name!r} is being loaded already", param="lora_name")
                if self._reader is None:
                    self._reader = ThreadPoolExecutor(1, thread_name_prefix="adapter-read")
                self._reads[msg.request_id] = (msg, self._reader.submit(self.engine.read_adapter, msg.name, msg.path))
            except SitsError as e:
                return [RequestError.of(msg.request_id, e)]
        elif isinstance(msg, UnloadAdapter):     # between steps: no request sees half an adapter
            try:
                self.engine.unload_adapter(msg.name)
            except SitsError as e:
                return [RequestError.of(msg.request_id, e)]
            return [AdaptersChanged(msg.request_id, self.engine.adapter_views())]
        elif isinstance(msg, Ping):
            if not self._faults.drop_pings:
                return [Pong(msg.seq)]
            self._dropped_ping = msg.seq
        elif isinstance(msg, FaultDirectives):
            self._faults, self._faults_since = msg, time.monotonic()
            if not msg.drop_pings and self._dropped_ping is not None:
                seq, self._dropped_ping = self._dropped_ping, None
                return [Pong(seq)]
        else:
            raise TypeError(f"EngineCore cannot handle {type(msg).__name__}")
        return []

    def close(self) -> None:
        """The driver is done: reads under way are dropped (their callers are told by the driver)."""
        if self._reader is not None:
            self._reader.shutdown(wait=False, cancel_futures=True)
        self._reads.clear()

    def finished_work(self) -> list[EngineOutput]:
        """Answers to work that finished off the step thread: adapters read, now served (call between steps)."""
        out: list[EngineOutput] = []
        for rid, (msg, fut) in list(self._reads.items()):
            if not fut.done():
                continue
            del self._reads[rid]
            try:
                self.engine.install_adapter(msg.name, fut.result())
                out.append(AdaptersChanged(rid, self.engine.adapter_views()))
            except SitsError as e:
                out.append(RequestError.of(rid, e))
            except Exception as e:     # noqa: BLE001 - one adapter's problem never takes the engine down
                out.append(RequestError.of(rid, SitsError(
                    f"the adapter {msg.name!r} could not be loaded: {type(e).__name__}: {e}")))
        return out

    def step(self) -> StepOutput:
        """One engine step: its token events and the requests that failed in it."""
        t0 = time.monotonic()
        events = self.engine.step()
        if (floor := self._step_floor_s()) > 0:
            time.sleep(max(0.0, floor - (time.monotonic() - t0)))    # fault: a degraded step
        return StepOutput(events, [RequestError.of(rid, e) for rid, e in self.engine.take_failures()])

    def idle_work(self) -> bool:
        return self.engine.idle_work()

    def stats(self) -> EngineStats:
        return self.engine.stats()

    def _step_floor_s(self) -> float:
        stages = self._faults.step_stages_ms
        if not stages:
            return 0.0
        stage_s = self._faults.stage_s
        i = int((time.monotonic() - self._faults_since) / stage_s) if stage_s > 0 else 0
        return stages[min(i, len(stages) - 1)] / 1e3
