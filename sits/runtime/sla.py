"""The SLA guard: a circuit breaker per unit over a sliding window of outcomes.

A response counts as a success when it finished without a server-side error *and* its time to first
token (as the gateway saw it: queueing, cold start and link delays included) met the unit's
``slo.ttft_ms``. When the success rate over ``window_s`` falls below ``success_rate`` (with at least
``min_requests`` outcomes), the breaker OPENs: the unit answers a fast 503 with ``Retry-After``, or
sends the request to its ``fallback`` unit. After ``open_s`` it goes HALF_OPEN and lets
``half_open_probes`` requests through; all of them succeeding closes it, any failure re-opens it.
Client errors (4xx) and client aborts are not outcomes: they say nothing about the unit's health.
"""

from __future__ import annotations

import collections
import enum
import math
import time
from collections.abc import Callable
from dataclasses import dataclass

from pydantic import BaseModel, ConfigDict, Field

from sits.engine.errors import SitsError

# errors that end a request without saying anything about the unit's health
NOT_OUTCOMES = frozenset({"server_shutting_down", "unit_deleted", "cancelled", "client_disconnected"})


class SlaBreakerOpenError(SitsError):
    code = "sla_breaker_open"
    http_status = 503


class SlaSpec(BaseModel):
    model_config = ConfigDict(extra="forbid")
    success_rate: float = Field(0.85, ge=0, le=1, description="the breaker opens below this share of successes")
    window_s: float = Field(30.0, gt=0, description="the sliding window of outcomes")
    min_requests: int = Field(10, ge=1, description="outcomes needed in the window before it can open")
    open_s: float = Field(5.0, gt=0, description="time open before half-open probes are let through")
    half_open_probes: int = Field(3, ge=1, description="probes that must all succeed to close again")


class BreakerState(str, enum.Enum):
    CLOSED = "CLOSED"
    OPEN = "OPEN"
    HALF_OPEN = "HALF_OPEN"


@dataclass(frozen=True, slots=True)
class Outcome:
    at: float
    ok: bool
    ttft_ms: float | None
    reason: str          # "ok", "slo_miss", or an error code


class SlaBreaker:
    def __init__(self, spec: SlaSpec, ttft_slo_ms: float,
                 on_transition: Callable[[BreakerState, BreakerState, str], None] | None = None,
                 clock: Callable[[], float] = time.monotonic):
        self.spec = spec
        self.ttft_slo_ms = ttft_slo_ms
        self.state = BreakerState.CLOSED
        self.trips = 0
        self.rejected = 0
        self.opened_at: float | None = None
        self._window: collections.deque[Outcome] = collections.deque()
        self._ok_in_window = 0        # running count, so an outcome costs O(1), not O(window)
        self._probes_out = 0          # half-open probes admitted, outcome pending
        self._probes_ok = 0
        self._epoch = 0               # bumped at every HALF_OPEN: a probe from an earlier one is ignored
        self._clock = clock
        self._on_transition = on_transition or (lambda a, b, why: None)

    # -- admission ------------------------------------------------------------------------------------
    def admits(self) -> bool:
        """May a request go to the unit now? (A HALF_OPEN admission is a probe: call ``probe_started``.)"""
        now = self._clock()
        if self.state is BreakerState.OPEN and now - (self.opened_at or now) >= self.spec.open_s:
            self._move(BreakerState.HALF_OPEN, f"{self.spec.open_s:g}s open: probing")
        if self.state is BreakerState.CLOSED:
            return True
        if self.state is BreakerState.HALF_OPEN:
            return self._probes_out + self._probes_ok < self.spec.half_open_probes
        return False

    def probe_started(self) -> int | None:
        """Count an admitted request as a probe when half-open; its ticket (the half-open episode), or None."""
        if self.state is BreakerState.HALF_OPEN:
            self._probes_out += 1
            return self._epoch
        return None

    def probe_cancelled(self, ticket: int | None) -> None:
        """An admitted probe ended without an outcome (the client went away): free its slot."""
        if ticket is not None and ticket == self._epoch and self.state is BreakerState.HALF_OPEN:
            self._probes_out = max(0, self._probes_out - 1)

    def retry_after_s(self) -> int:
        if self.state is not BreakerState.OPEN or self.opened_at is None:
            return 1
        return max(1, math.ceil(self.spec.open_s - (self._clock() - self.opened_at)))

    # -- outcomes -------------------------------------------------------------------------------------
    def classify(self, ttft_ms: float | None, error_code: str | None) -> Outcome:
        now = self._clock()
        if error_code is not None:
            return Outcome(now, False, ttft_ms, error_code)
        if ttft_ms is not None and ttft_ms > self.ttft_slo_ms:
            return Outcome(now, False, ttft_ms, "slo_miss")
        return Outcome(now, True, ttft_ms, "ok")

    def record(self, outcome: Outcome, *, probe: int | None = None) -> None:
        """``probe``: the ticket of ``probe_started`` (a probe of an earlier episode counts as a plain outcome)."""
        self._window.append(outcome)
        self._ok_in_window += outcome.ok
        self._trim(outcome.at)
        if probe is not None and probe == self._epoch and self.state is BreakerState.HALF_OPEN:
            self._probes_out = max(0, self._probes_out - 1)
            if not outcome.ok:
                self._open(f"half-open probe failed ({outcome.reason})")
                return
            self._probes_ok += 1
            if self._probes_ok >= self.spec.half_open_probes:
                self._window.clear()       # a fresh window: the failures that opened it are history
                self._ok_in_window = 0
                self._move(BreakerState.CLOSED, f"{self._probes_ok} probe(s) succeeded")
            return
        if self.state is BreakerState.CLOSED:
            n = len(self._window)
            rate = self.attainment()
            if n >= self.spec.min_requests and rate is not None and rate < self.spec.success_rate:
                self._open(f"success rate {rate:.2f} < {self.spec.success_rate:g} over {n} request(s)")

    def _open(self, why: str) -> None:
        self.opened_at = self._clock()
        self.trips += 1
        self._move(BreakerState.OPEN, why)

    def _move(self, to: BreakerState, why: str) -> None:
        frm, self.state = self.state, to
        self._probes_out = self._probes_ok = 0
        if to is BreakerState.HALF_OPEN:
            self._epoch += 1
        self._on_transition(frm, to, why)

    def _trim(self, now: float) -> None:
        cut = now - self.spec.window_s
        while self._window and self._window[0].at < cut:
            self._ok_in_window -= self._window.popleft().ok

    def attainment(self) -> float | None:
        """The share of successes in the window (None with no outcomes)."""
        self._trim(self._clock())
        if not self._window:
            return None
        return self._ok_in_window / len(self._window)

    def view(self) -> dict:
        rate = self.attainment()
        misses = collections.Counter(o.reason for o in self._window if not o.ok)
        return {"state": self.state.value, "ttft_slo_ms": self.ttft_slo_ms, "success_rate_target": self.spec.success_rate,
                "attainment": None if rate is None else round(rate, 4), "window_s": self.spec.window_s,
                "requests_in_window": len(self._window), "failures": dict(misses), "trips": self.trips,
                "rejected": self.rejected,
                "retry_after_s": self.retry_after_s() if self.state is BreakerState.OPEN else None}
