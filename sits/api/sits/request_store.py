"""SITS-dialect requests that clients follow: their lifecycle, their event log, bounded retention.

Each ``TrackedRequest`` keeps an append-only log of events (state transitions and token deltas),
numbered from 1, which is what ``GET /v1/requests/{id}/events`` streams and what ``Last-Event-ID``
resumes from. Finished requests stay readable for ``retention_s`` and at most ``max_finished`` of
them are kept, so memory stays bounded however long the server runs.
"""

from __future__ import annotations

import asyncio
import time
from collections import OrderedDict
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from sits.api.errors import RequestNotFoundError
from sits.api.sits.lifecycle import LifecycleEvent, RequestLifecycle, RequestState, Subscriber
from sits.engine.errors import SitsError
from sits.tenancy.principal import current_principal


class TooManyRequestsError(SitsError):
    code = "too_many_requests"
    http_status = 429


@dataclass(slots=True)
class LoggedEvent:
    id: int
    kind: str                # "state" | "delta" | "tool_call" | "tool_result"
    data: dict[str, Any]


@dataclass
class TrackedRequest:
    id: str
    unit: str | None
    lifecycle: RequestLifecycle = field(init=False)
    log: list[LoggedEvent] = field(default_factory=list)
    output: list[str] = field(default_factory=list)
    finish_reason: str | None = None
    usage: dict[str, Any] | None = None
    timings: dict[str, float | None] = field(default_factory=dict)
    error: dict[str, Any] | None = None
    task: asyncio.Task | None = None
    cancel_reason: tuple[str, str] | None = None     # (code, message) set by DELETE
    finished_at: float | None = None                 # time.monotonic() when terminal
    trace: Any = None                                # the execution's tracing Scope, when traced
    citations: list[dict] = field(default_factory=list)      # memories retrieved for it (memory_ref)
    memories_written: list[str] = field(default_factory=list)
    tool_steps: list[dict] = field(default_factory=list)     # the tool loop's steps that called tools
    owner: str | None = None                         # the tenant that submitted it (None: no tenants)
    owner_key: str | None = None                     # ... and its key
    _wake: asyncio.Event = field(default_factory=asyncio.Event)

    def start(self, subscribers: list[Subscriber]) -> None:
        self.lifecycle = RequestLifecycle(self.id, [self._on_transition, *subscribers])

    # -- the log --------------------------------------------------------------------------------
    def _append(self, kind: str, data: dict[str, Any]) -> None:
        self.log.append(LoggedEvent(len(self.log) + 1, kind, data))
        wake, self._wake = self._wake, asyncio.Event()
        wake.set()

    def _on_transition(self, ev: LifecycleEvent) -> None:
        if ev.state.terminal:
            self.finished_at = time.monotonic()
            if ev.payload and "error" in ev.payload:
                self.error = ev.payload["error"]
        self._append("state", ev.to_dict())

    def add_delta(self, index: int, text: str, token_id: int | None, step: int | None = None) -> None:
        self.output.append(text)
        self._append("delta", {"request_id": self.id, "index": index, "text": text, "token_id": token_id,
                               **({"step": step} if step is not None else {})})

    def add_event(self, kind: str, data: dict[str, Any]) -> None:
        self._append(kind, data)

    def end_step(self, step: dict[str, Any]) -> None:
        """A tool-loop step that called tools is over: its text leaves the output (the answer is
        the last step's) and is kept, with its calls, in ``tool_steps``."""
        self.tool_steps.append(step)
        self.output.clear()

    def record_result(self, call_id: str, output: str | None, error: dict | None) -> None:
        for call in self.tool_steps[-1]["calls"] if self.tool_steps else []:
            if call["id"] == call_id:
                call["result"] = {"output": output} if error is None else {"error": error}

    @property
    def state(self) -> RequestState:
        return self.lifecycle.state

    async def follow(self, after: int = 0, keepalive_s: float = 15.0) -> AsyncIterator[LoggedEvent | None]:
        """Events with id > ``after`` as they happen, until the terminal one; None = keep-alive tick."""
        cursor = max(0, after)
        while True:
            wake = self._wake
            while cursor < len(self.log):
                ev = self.log[cursor]
                cursor += 1
                yield ev
            if self.lifecycle.terminal:
                return
            try:
                await asyncio.wait_for(wake.wait(), keepalive_s)
            except TimeoutError:
                yield None

    def view(self, base_url: str = "") -> dict[str, Any]:
        created = self.lifecycle.history[0].timestamp_ns
        terminal = self.lifecycle.terminal
        return {
            "id": self.id, "object": "sits.request", "unit": self.unit, "state": self.state.value,
            "created_ns": created, "updated_ns": self.lifecycle.history[-1].timestamp_ns,
            "transitions": [{"state": e.state.value, "timestamp_ns": e.timestamp_ns}
                            for e in self.lifecycle.history],
            "output": "".join(self.output) if terminal else None,
            "finish_reason": self.finish_reason, "usage": self.usage, "timings": self.timings,
            "error": self.error, "events_url": f"{base_url}/v1/requests/{self.id}/events",
            "citations": self.citations or None, "memories_written": self.memories_written or None,
            "tool_steps": self.tool_steps or None,
        }


class RequestStore:
    def __init__(self, *, retention_s: float = 600.0, max_finished: int = 10_000, max_pending: int = 4096):
        self.retention_s = retention_s
        self.max_finished = max_finished
        self.max_pending = max_pending
        self._live: dict[str, TrackedRequest] = {}
        self._finished: OrderedDict[str, TrackedRequest] = OrderedDict()

    def create(self, request_id: str, unit: str | None, subscribers: list[Subscriber]) -> TrackedRequest:
        self.sweep()
        if len(self._live) >= self.max_pending:
            raise TooManyRequestsError(f"{len(self._live)} requests are unfinished (limit {self.max_pending}); "
                                       "retry later")
        principal = current_principal.get()
        tr = TrackedRequest(request_id, unit, owner=principal.tenant, owner_key=principal.key_id)
        self._live[request_id] = tr
        tr.start([*subscribers, lambda ev: self._on_transition(tr, ev)])
        return tr

    def _on_transition(self, tr: TrackedRequest, ev: LifecycleEvent) -> None:
        if ev.state.terminal:
            self._live.pop(tr.id, None)
            self._finished[tr.id] = tr

    def get(self, request_id: str) -> TrackedRequest:
        self.sweep()
        tr = self._live.get(request_id) or self._finished.get(request_id)
        if tr is None or tr.owner != current_principal.get().tenant:    # another tenant's id: not found
            raise RequestNotFoundError(f"no request {request_id!r} (unknown, or finished more than "
                                       f"{self.retention_s:g} s ago and dropped)", param="id")
        return tr

    def sweep(self) -> int:
        """Drop finished requests past retention or over the cap (oldest first)."""
        now = time.monotonic()
        dropped = 0
        while self._finished:
            rid, tr = next(iter(self._finished.items()))
            if len(self._finished) > self.max_finished or now - (tr.finished_at or now) > self.retention_s:
                del self._finished[rid]
                dropped += 1
            else:
                break
        return dropped

    def unfinished_of(self, tenant: str, key_id: str | None = None) -> int:
        """How many of a tenant's (or one of its keys') requests are not finished."""
        return sum(1 for tr in self._live.values() if tr.owner == tenant and (key_id is None or tr.owner_key == key_id))

    def live(self) -> list[TrackedRequest]:
        return list(self._live.values())

    def __len__(self) -> int:
        return len(self._live) + len(self._finished)
