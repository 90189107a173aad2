"""The front end's side of an instance process: the same Backend API as an in-process engine.

``InstanceBackend.spawn`` starts ``sits.runtime.instance_worker`` on a private Unix socket and follows
its cold start. Requests are validated and tokenized here, in the front end's process, with the
limits the instance reported (``RequestValidator``, once: the engine trusts them); only token ids
cross the socket. Each step's events are dispatched to per-request queues from the socket's
``data_received`` (``FrameProtocol``). If the process dies, every open stream gets ``EngineDeadError`` at once and ``ready`` turns false.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import asdict

import numpy as np

from sits.engine.async_engine import AdapterCalls, events_until_finished
from sits.engine.config import EngineConfig, generation_defaults
from sits.engine.errors import DuplicateRequestError, EngineDeadError, ModelLoadError, RequestAbortedError, SitsError
from sits.engine.lora import AdapterNotFoundError
from sits.engine.messages import (AbortRequest, AdaptersChanged, EmbedRequest, Embedded, EngineInput, EngineRequest,
                                  EngineStats, Fatal, FaultDirectives, Hello, Ping, Pong, Ready,
                                  RequestError, Shutdown, StepOutput, TokenEvent)
from sits.engine.request_validator import RequestValidator
from sits.engine.sampling_params import SamplingParams
from sits.engine.tokenizer import Tokenizer
from sits.runtime.features import NO_FEATURES
from sits.runtime.wire import FrameProtocol, encode


class InstanceBackend(AdapterCalls):
    def __init__(self, name: str, cfg: EngineConfig, proc: subprocess.Popen, conn: FrameProtocol,
                 info: Ready, tokenizer: Tokenizer, sock_dir: str):
        self.name = name
        self.cfg = cfg
        self.root = str(cfg.model)
        self.created = int(time.time())
        self.proc = proc
        self.pid = info.pid
        self.limits = info.limits
        self.max_model_len = info.limits.max_model_len
        self.max_num_seqs = cfg.max_num_seqs
        self.tokenizer = tokenizer
        self.features = NO_FEATURES          # a unit declares its own; ``SupervisedInstance`` its cost shape
        self.sampling_defaults = generation_defaults(cfg.model)
        self.validator = RequestValidator(tokenizer, info.limits)
        self.kv_capacity_tokens = self.validator.kv_capacity_tokens
        self.cold_start = info.cold_start
        self._conn = conn
        self._sock_dir = sock_dir
        self._streams: dict[str, asyncio.Queue] = {}
        self._calls: dict[str, asyncio.Future] = {}       # embeddings and adapter changes, answered between steps
        self._call_ids = itertools.count()
        self.adapters: list[dict] = list(info.adapters)   # the LoRA adapters the instance serves
        self._stats: EngineStats | None = None
        self._dead: str | None = None
        self._closing = False
        self.last_pong = time.monotonic()        # health: the instance answered a ping (or just started)
        self._ping_seq = 0
        self._ping_sent: float | None = None     # an unanswered ping went out at this time
        self.on_lost: Callable[[str], None] | None = None    # told once if the process dies (not on shutdown)
        conn.attach(self._dispatch, self._lost)      # a frame sent after "ready" (stats) is not lost

    # -- start ----------------------------------------------------------------------------------------
    @classmethod
    async def spawn(cls, cfg: EngineConfig, name: str | None = None, *, start_timeout_s: float = 600.0,
                    stderr=None, on_phase=None, launcher=None,
                    tokenizer: Tokenizer | None = None) -> "InstanceBackend":
        """Start an instance process for ``cfg`` and return once its engine is loaded and warm.

        ``on_phase(phase, info)`` is told ``"spawned"`` (process started, ``pid``), ``"loading"`` (the
        process is up and answering: imports done, weights next) and nothing more: the return is READY.
        ``launcher(socket_path, config_dict)`` starts the process (default: a fresh interpreter; the
        runtime passes its zygote's fork) and returns a handle with ``pid``, ``poll``, ``wait``, ``kill``.
        ``tokenizer``: the model's, already loaded by the caller (a unit's); else it is loaded here,
        in a thread beside the start (≈ 20 ms on a small host, in the caller's process, on the cold path).
        """
        name = name or os.path.basename(os.path.normpath(str(cfg.model)))
        sock_dir = tempfile.mkdtemp(prefix="sits-instance-")
        path = os.path.join(sock_dir, "engine.sock")
        if launcher is None:
            proc = subprocess.Popen([sys.executable, "-m", "sits.runtime.instance_worker", "--socket", path,
                                     "--config", json.dumps(asdict(cfg))], stdin=subprocess.DEVNULL, stderr=stderr)
        else:
            try:
                proc = await launcher(path, asdict(cfg))
            except BaseException:
                shutil.rmtree(sock_dir, ignore_errors=True)
                raise
        if on_phase is not None:
            node = getattr(proc, "node_id", None)
            on_phase("spawned", {"pid": proc.pid, "node": node[:12] if node else None})
        conn: FrameProtocol | None = None
        tokenizer_task = None if tokenizer is not None else asyncio.create_task(
            asyncio.to_thread(Tokenizer.from_dir, cfg.model))
        try:
            address = getattr(proc, "address", None)
            if address is not None and address.startswith("tcp://"):      # an instance on another node
                conn = await asyncio.wait_for(cls._connect_tcp(address, proc.token), start_timeout_s)
            else:
                conn = await asyncio.wait_for(cls._connect(path, proc), start_timeout_s)
            hello = await conn.next_frame()
            assert isinstance(hello, Hello), hello
            if on_phase is not None:
                on_phase("loading", {"pid": hello.pid})
            msg = await asyncio.wait_for(conn.next_frame(), start_timeout_s)
            if isinstance(msg, Fatal):
                raise ModelLoadError(f"instance for {cfg.model} failed to start: {msg.message}", code=msg.code)
            assert isinstance(msg, Ready), msg
            if tokenizer_task is not None:
                tokenizer = await tokenizer_task
        except BaseException:
            # the instance's own error is the one to report; the tokenizer's (same cause) is consumed
            if tokenizer_task is not None:
                tokenizer_task.add_done_callback(lambda t: t.cancelled() or t.exception())
            if conn is not None and conn.transport is not None:
                conn.transport.close()
            proc.kill()
            await asyncio.to_thread(proc.wait)
            shutil.rmtree(sock_dir, ignore_errors=True)
            raise
        return cls(name, cfg, proc, conn, msg, tokenizer, sock_dir)

    @staticmethod
    async def _connect(path: str, proc: subprocess.Popen) -> FrameProtocol:
        loop = asyncio.get_running_loop()
        while True:
            if proc.poll() is not None:
                raise ModelLoadError(f"instance process exited with {proc.returncode} before listening")
            if os.path.exists(path):
                try:
                    _, conn = await loop.create_unix_connection(FrameProtocol, path)
                    return conn
                except (ConnectionRefusedError, FileNotFoundError):
                    pass
            await asyncio.sleep(0.002)

    @staticmethod
    async def _connect_tcp(address: str, token: str) -> FrameProtocol:
        """An instance's TCP address (it listens before the fork is reported): its token goes first."""
        host, _, port = address[len("tcp://"):].rpartition(":")
        _, conn = await asyncio.get_running_loop().create_connection(FrameProtocol, host.strip("[]"), int(port))
        conn.transport.get_extra_info("socket").setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        conn.transport.write(token.encode())
        return conn

    # -- the Backend API ------------------------------------------------------------------------------
    @property
    def ready(self) -> bool:
        return self._dead is None and not self._closing and self.proc.poll() is None

    def prepare(self, prompt: str | list[int], params: SamplingParams, *, request_id: str, priority: int = 0,
                interactive: bool = True, add_special_tokens: bool = True, lora: str | None = None) -> EngineRequest:
        if self._dead is not None:
            raise EngineDeadError(f"the instance of {self.name} is gone: {self._dead}")
        if lora is not None and not any(a["name"] == lora for a in self.adapters):
            raise AdapterNotFoundError(f"no LoRA adapter {lora!r} is loaded on {self.name}", param="model")
        ids = self.validator.prompt_ids(prompt, params, priority, add_special_tokens=add_special_tokens)
        if request_id in self._streams:
            raise DuplicateRequestError(f"request id {request_id!r} is already in use", param="request_id")
        return EngineRequest(request_id, ids, params, priority, interactive, lora=lora)

    async def stream(self, req: EngineRequest, hints=None) -> AsyncIterator[TokenEvent]:
        """``hints`` are for backends that route; one instance has nothing to choose."""
        rid = req.request_id
        if rid in self._streams:
            raise DuplicateRequestError(f"request id {rid!r} is already in use", param="request_id")
        if self._dead is not None:
            raise EngineDeadError(f"the instance of {self.name} is gone: {self._dead}")
        q: asyncio.Queue = asyncio.Queue()
        self._streams[rid] = q
        self._send(req)
        finished = False
        try:
            async for ev in events_until_finished(q):
                yield ev
                finished = ev.finished
        finally:
            if self._streams.get(rid) is q:
                del self._streams[rid]
            if not finished:
                self._send(AbortRequest(rid))

    async def embed(self, inputs: list[list[int]]) -> np.ndarray:
        """Mean-pooled hidden states, computed by the instance between two engine steps."""
        if self._dead is not None:
            raise EngineDeadError(f"the instance of {self.name} is gone: {self._dead}")
        return await self._call(lambda rid: EmbedRequest(rid, inputs))

    async def _call(self, message):
        """Send ``message(rid)`` and wait for its answer (or its ``RequestError``)."""
        if self._dead is not None:
            raise EngineDeadError(f"the instance of {self.name} is gone: {self._dead}")
        rid = f"call-{next(self._call_ids)}"
        fut: asyncio.Future = asyncio.get_running_loop().create_future()
        self._calls[rid] = fut
        try:
            self._send(message(rid))
            return await fut
        finally:
            self._calls.pop(rid, None)

    def abort(self, request_id: str, error: SitsError | None = None) -> None:
        self._send(AbortRequest(request_id))
        q = self._streams.pop(request_id, None)
        if q is not None:
            q.put_nowait(error or RequestAbortedError(f"request {request_id} was aborted"))

    def ping(self) -> None:
        """Ask for a pong (answered between engine steps); ``unanswered_s`` says how long it is pending."""
        if self._ping_sent is None:
            self._ping_seq += 1
            self._ping_sent = time.monotonic()
            self._send(Ping(self._ping_seq))

    def send_directives(self, directives: dict) -> None:
        """Fault injection: a step-time floor (staged) and whether to ignore pings (see sits.faults)."""
        self._send(FaultDirectives(tuple(directives.get("step_stages_ms") or ()),
                                   float(directives.get("stage_s") or 0.0), bool(directives.get("drop_pings"))))

    @property
    def unanswered_s(self) -> float:
        return 0.0 if self._ping_sent is None else time.monotonic() - self._ping_sent

    def admit(self) -> "InstanceBackend":
        return self

    def session_instance(self, session_id: str) -> None:
        return None

    def stats(self) -> EngineStats:
        if self._stats is not None:
            return self._stats
        n = self.validator.num_kv_blocks
        return EngineStats(0, 0, 0.0, n, n, 0, 0, 0.0, 0, 0, self.cfg.policy, self.cold_start)

    async def shutdown(self, timeout_s: float = 10.0) -> None:
        self._closing = True
        self._send(Shutdown())
        try:
            await asyncio.wait_for(asyncio.to_thread(self.proc.wait), timeout_s)
        except TimeoutError:
            self.proc.kill()
            await asyncio.to_thread(self.proc.wait)
        if self._conn.transport is not None:
            self._conn.transport.close()
        shutil.rmtree(self._sock_dir, ignore_errors=True)

    # -- the socket -----------------------------------------------------------------------------------
    def _send(self, msg: EngineInput) -> None:
        if self._dead is None:
            self._conn.write(encode(msg))

    def _dispatch(self, msg) -> None:
        """Hand one output to whoever waits for it (called from the socket's ``data_received``)."""
        if isinstance(msg, StepOutput):
            for ev in msg.events:
                q = self._streams.get(ev.request_id)
                if q is not None:
                    q.put_nowait(ev)
            for err in msg.errors:
                self._fail(err)
        elif isinstance(msg, EngineStats):
            self._stats = msg
        elif isinstance(msg, (Embedded, AdaptersChanged)):
            fut = self._calls.get(msg.request_id)
            if fut is not None and not fut.done():
                fut.set_result(msg.vectors if isinstance(msg, Embedded) else msg.adapters)
        elif isinstance(msg, Pong):
            self.last_pong = time.monotonic()
            self._ping_sent = None
        elif isinstance(msg, RequestError):
            self._fail(msg)

    def _fail(self, err: RequestError) -> None:
        if (q := self._streams.get(err.request_id)) is not None:
            q.put_nowait(err.to_exception())
        elif (fut := self._calls.get(err.request_id)) is not None and not fut.done():
            fut.set_exception(err.to_exception())

    def _lost(self, reason: str) -> None:
        """The connection ended: every open stream and embedding gets EngineDeadError at once."""
        if self._dead is not None:
            return
        self._dead = reason
        if not self._closing:
            err = EngineDeadError(f"the instance of {self.name} died: {reason}")
            for q in self._streams.values():
                q.put_nowait(err)
            for fut in self._calls.values():
                if not fut.done():
                    fut.set_exception(err)
            if self.on_lost is not None:
                self.on_lost(reason)
