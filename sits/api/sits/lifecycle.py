"""The request state machine: PENDING -> VALIDATING -> EXECUTING -> RESOLVED | REJECTED.

One class owns a request's state and enforces the transition table (an illegal transition raises).
Every transition becomes one ``LifecycleEvent`` handed to each subscriber in order: the SSE events
stream, the webhook dispatcher and the metrics all listen the same way, so what they report can
never disagree.
"""

from __future__ import annotations

import enum
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from sits.engine.errors import SitsError


class RequestState(str, enum.Enum):
    PENDING = "PENDING"          # accepted by the gateway: id and timestamp assigned
    VALIDATING = "VALIDATING"    # schema, unit, tools, budget and context length being checked
    EXECUTING = "EXECUTING"      # on an instance, KV blocks reserved, generating
    RESOLVED = "RESOLVED"        # finished: output, finish reason, usage, timings
    REJECTED = "REJECTED"        # failed, cancelled or timed out: a machine-readable code

    @property
    def terminal(self) -> bool:
        return self in (RequestState.RESOLVED, RequestState.REJECTED)


TRANSITIONS: dict[RequestState, frozenset[RequestState]] = {
    RequestState.PENDING: frozenset({RequestState.VALIDATING, RequestState.REJECTED}),
    RequestState.VALIDATING: frozenset({RequestState.EXECUTING, RequestState.REJECTED}),
    RequestState.EXECUTING: frozenset({RequestState.RESOLVED, RequestState.REJECTED}),
    RequestState.RESOLVED: frozenset(),
    RequestState.REJECTED: frozenset(),
}


class IllegalTransitionError(SitsError):
    """A transition the table does not allow (a bug in the caller, never a user error)."""

    code = "illegal_transition"
    http_status = 409


@dataclass(frozen=True, slots=True)
class LifecycleEvent:
    request_id: str
    state: RequestState
    timestamp_ns: int
    payload: dict[str, Any] | None = None     # only on terminal states

    def to_dict(self) -> dict[str, Any]:
        d: dict[str, Any] = {"request_id": self.request_id, "state": self.state.value,
                             "timestamp_ns": self.timestamp_ns}
        if self.payload is not None:
            d["payload"] = self.payload
        return d


Subscriber = Callable[[LifecycleEvent], None]


class RequestLifecycle:
    """The state of one request; ``advance`` is the only way to change it."""

    __slots__ = ("request_id", "state", "history", "_subscribers")

    def __init__(self, request_id: str, subscribers: list[Subscriber] | None = None):
        self.request_id = request_id
        self._subscribers: list[Subscriber] = list(subscribers or [])
        self.state = RequestState.PENDING
        self.history: list[LifecycleEvent] = []
        self._emit(LifecycleEvent(request_id, RequestState.PENDING, time.time_ns()))

    def subscribe(self, fn: Subscriber) -> None:
        self._subscribers.append(fn)

    @property
    def terminal(self) -> bool:
        return self.state.terminal

    def can_advance(self, to: RequestState) -> bool:
        return to in TRANSITIONS[self.state]

    def advance(self, to: RequestState, payload: dict[str, Any] | None = None) -> LifecycleEvent:
        """Move to ``to``; raises IllegalTransitionError when the table forbids it.

        ``payload`` belongs to terminal states only (output and usage, or the error code).
        """
        if to not in TRANSITIONS[self.state]:
            raise IllegalTransitionError(
                f"request {self.request_id}: {self.state.value} -> {to.value} is not a legal transition "
                f"(allowed from {self.state.value}: "
                f"{', '.join(sorted(s.value for s in TRANSITIONS[self.state])) or 'none, it is terminal'})")
        if payload is not None and not to.terminal:
            raise ValueError("only terminal states carry a payload")
        self.state = to
        event = LifecycleEvent(self.request_id, to, time.time_ns(), payload if to.terminal else None)
        self._emit(event)
        return event

    def reject(self, code: str, message: str, **extra: Any) -> LifecycleEvent | None:
        """REJECTED with ``{"error": {"code", "message"}}``; a no-op on an already terminal request."""
        if self.state.terminal:
            return None
        return self.advance(RequestState.REJECTED, {"error": {"code": code, "message": message, **extra}})

    def _emit(self, event: LifecycleEvent) -> None:
        self.history.append(event)
        for fn in self._subscribers:
            fn(event)

    def timestamp_of(self, state: RequestState) -> int | None:
        for ev in self.history:
            if ev.state is state:
                return ev.timestamp_ns
        return None
