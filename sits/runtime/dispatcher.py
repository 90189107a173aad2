"""Which instance serves a request: acquire a READY one (waiting through a cold start), route it,
stream from it, and resume on another when it dies (failover as a resume: the tokens already sent
are re-prefilled and the rest is asked for).

``UnitDispatcher`` works for one unit and needs of it only what ``DispatchedUnit`` lists: the pool
it acquires instances from and the instance's ``backend`` (``stream`` / ``abort`` / ``embed``), the
metrics window, the SLA breaker an outcome goes to, the faults that wrap a stream, and the host it
reports to. An instance behind that interface could be a local process, a Ray actor or a remote
endpoint without this module changing.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Protocol

import numpy as np

from sits.engine.errors import EngineDeadError, RequestAbortedError, SitsError
from sits.engine.messages import EngineRequest, TokenEvent
from sits.engine.sampling_params import SamplingParams
from sits.observe import tracing
from sits.runtime.hints import RequestHints
from sits.tenancy.principal import current_charges, current_principal
from sits.runtime.router import Router, prefix_hashes
from sits.runtime.sla import NOT_OUTCOMES
from sits.runtime.unit_guard import record_outcome

if TYPE_CHECKING:
    from sits.faults import FaultInjector
    from sits.runtime.sla import SlaBreaker
    from sits.runtime.unit_metrics import MetricsWindow
    from sits.runtime.unit_pool import UnitPool
    from sits.runtime.unit_spec import UnitSpec

log = logging.getLogger("sits.runtime")

MAX_FAILOVERS = 3      # a request that kills this many instances is not retried further


class DispatchedUnit(Protocol):
    """What the dispatcher needs of its unit (``gateway.UnitBackend`` is one)."""

    name: str
    spec: UnitSpec
    pool: UnitPool
    window: MetricsWindow
    breaker: SlaBreaker
    faults: FaultInjector
    host: object        # gateway.UnitHost: record / kick / observe_call


@dataclass(slots=True)
class StreamProgress:
    """What one request's stream has delivered so far, across failovers: the tokens sent (a resume
    re-prefills them) and the timings of the first token, which a resumed stream keeps."""

    request: EngineRequest
    sent: list[int] = field(default_factory=list)
    ttft_ms: float | None = None              # the engine's time to first token
    gateway_ttft_ms: float | None = None      # the gateway's own (queueing, cold start, link delays included)
    first_token_time: float | None = None
    first_scheduled_time: float | None = None
    cached: int = 0
    itls: list[float] = field(default_factory=list)
    finished: bool = False
    _prev: float | None = None

    @property
    def left(self) -> int:
        """Output tokens the request may still produce."""
        return self.request.params.max_tokens - len(self.sent)

    def took(self, ev: TokenEvent, resumed_at: int) -> TokenEvent:
        """Account for ``ev``; a resumed stream's events are renumbered after the ``resumed_at`` tokens
        sent before it, and carry the first attempt's timings."""
        if resumed_at:
            ev = replace(ev, index=ev.index + resumed_at, num_output_tokens=ev.num_output_tokens + resumed_at,
                         num_prompt_tokens=len(self.request.prompt_token_ids), num_cached_tokens=self.cached,
                         arrival_time=self.request.arrival_time, first_token_time=self.first_token_time,
                         first_scheduled_time=self.first_scheduled_time)
        if ev.token_id is not None:
            self.sent.append(ev.token_id)
            if self.ttft_ms is None and ev.first_token_time is not None:
                self.ttft_ms = (ev.first_token_time - ev.arrival_time) * 1e3
                self.first_token_time, self.first_scheduled_time = ev.first_token_time, ev.first_scheduled_time
                self.cached = ev.num_cached_tokens
            if self._prev is not None:
                self.itls.append((ev.time - self._prev) * 1e3)
            self._prev = ev.time
            if self.gateway_ttft_ms is None:
                self.gateway_ttft_ms = (time.monotonic() - self.request.arrival_time) * 1e3
        self.finished = self.finished or ev.finished
        return ev


class UnitDispatcher:
    """Requests of one unit: who waits, where each runs, and the accounting the autoscaler reads."""

    def __init__(self, unit: DispatchedUnit):
        self.unit = unit
        self.router = Router()
        self.routed: collections.Counter = collections.Counter()
        self.waiting = 0
        self.inflight = 0
        self.idle_since: float | None = time.monotonic()
        self._waiters: dict[str, asyncio.Future] = {}
        self._placed: dict[str, object] = {}      # request id -> instance backend serving it

    def in_use(self, request_id: str) -> bool:
        return request_id in self._placed or request_id in self._waiters

    def abort_waiting(self, error: SitsError) -> None:
        """Every request still waiting for an instance ends with ``error`` (the unit is going away)."""
        for rid in list(self._waiters):
            self.abort(rid, error)

    async def acquire(self, rid: str, seq: EngineRequest, hashes: list[int], session_id: str | None, lag_s: float = 0.0):
        """A READY instance for this request and why the router picked it, or the error it was aborted with."""
        budget = len(seq.prompt_token_ids) + seq.params.max_tokens

        def choose(ready):
            inst, why = self.router.choose(ready, hashes, budget, session_id)
            self.routed[why] += 1
            reasons.append(why)
            return inst

        reasons: list[str] = []

        self.waiting += 1
        aborted: asyncio.Future = asyncio.get_running_loop().create_future()
        self._waiters[rid] = aborted
        try:
            async def lagged_acquire():
                if lag_s:
                    await asyncio.sleep(lag_s)     # fault: held in the gateway queue (abortable, like any wait)
                return await self.unit.pool.acquire(on_wait=lambda: self.unit.host.kick(self.unit.name), choose=choose)

            acquire = asyncio.ensure_future(lagged_acquire())
            done, _ = await asyncio.wait({acquire, aborted}, return_when=asyncio.FIRST_COMPLETED)
            if aborted in done:
                acquire.cancel()
                raise aborted.result()
            return acquire.result(), (reasons[-1] if reasons else None)
        finally:
            self.waiting -= 1
            self._waiters.pop(rid, None)
            if not aborted.done():
                aborted.cancel()

    def _trace_route(self, start: float, inst, why: str | None, failovers: int) -> None:
        """The route stage (queueing in the gateway included); if this request waited for the instance's
        cold start, a ``cold_start`` span with one child per phase (laid end to end, as measured)."""
        current = tracing.current_scope.get()
        if current is None:
            return
        now = time.monotonic()
        current.marks["routed"] = now        # the engine's queue stage starts here, not at prepare
        scope = tracing.stage("route", start, now, level="L1",
                              attributes={"sits.unit": self.unit.name, "sits.instance": inst.id,
                                          "sits.route.reason": why,
                                          "sits.failover": failovers or None})
        if inst.ready_at is not None and inst.ready_at > start and inst.report:
            cs = tracing.stage("cold_start", max(inst.requested_at, start), inst.ready_at, parent=scope, level="L1",
                               async_mechanism="fork" if "fork" in inst.report.get("phases_ms", {}) else "spawn",
                               attributes={"sits.instance": inst.id, "sits.pid": inst.pid})
            t = inst.requested_at
            for phase, ms in inst.report.get("phases_ms", {}).items():
                tracing.stage(f"cold_start.{phase}", t, t + ms / 1e3, parent=cs, level="L1")
                t += ms / 1e3

    async def stream(self, seq: EngineRequest, hints: RequestHints | None = None) -> AsyncIterator[TokenEvent]:
        """Stream from an instance; if it dies mid-stream, resume on another one. The end is one
        outcome for the SLA breaker.

        Failover re-prefills the prompt plus the tokens already sent and asks for the rest, so the
        client's stream goes on with no gap and no duplicate (greedy output is the same tokens as an
        uninterrupted run; a seeded sampler restarts its random stream at the resume point).

        The outcome's TTFT is the gateway's own (from ``prepare``: queueing, cold start and link
        delays included), because that is what the client waited for. One client request is one
        outcome (and at most one probe): its first sequence speaks for it (``<id>-0``; n > 1 and
        prompt lists add sequences ``-1``, ``-2``, ...). A stream that ends early is still an SLO miss
        once it waited longer than the SLO.
        """
        self.unit.window.arrival()
        self.idle_since = None
        primary = seq.request_id.endswith("-0")
        probe = self.unit.breaker.probe_started() if primary else None
        error_code: str | None = None
        rid = seq.request_id
        progress = StreamProgress(seq)
        failovers = 0
        cur = seq
        hints = hints or RequestHints()
        self.unit.host.observe_call(self.unit.name, hints)
        hashes = prefix_hashes(seq.prompt_token_ids)
        faults = self.unit.faults
        lag = faults.queue_lag_s(hints.path) if faults.active else 0.0
        hold_first = faults.first_frame_s(hints.path) if faults.active else 0.0
        try:
            while True:
                t_route = seq.arrival_time if not failovers else time.monotonic()   # gateway queueing included
                inst, why = await self.acquire(rid, cur, hashes, hints.session_id, lag)
                lag = 0.0
                self._trace_route(t_route, inst, why, failovers)
                self.router.record(inst.id, hashes, hints.session_id)
                placed_at = time.monotonic()
                if not inst.cold_start_claimed and inst.ready_at is not None and inst.requested_at >= t_route - 0.5 \
                        and inst.ready_at > t_route:        # this request's wait started the instance
                    inst.cold_start_claimed = True
                    if (charges := current_charges.get()) is not None:
                        charges.cold_starts += 1
                inst.inflight += 1
                self.inflight += 1
                self._placed[rid] = inst.backend
                events = inst.backend.stream(cur)
                if faults.active:
                    events = faults.delayed(events, hints.path, hold_first_s=hold_first)
                resumed_at = len(progress.sent)
                try:
                    async for ev in events:
                        hold_first = 0.0
                        ev = progress.took(ev, resumed_at)
                        if ev.finished:
                            self.unit.window.finished(progress.ttft_ms, (ev.time - ev.arrival_time) * 1e3,
                                                 ev.num_output_tokens, progress.itls)
                        yield ev
                    return
                except EngineDeadError as e:
                    if failovers >= MAX_FAILOVERS or progress.left <= 0:
                        raise
                    failovers += 1
                    self.unit.host.record(self.unit.name, "failover", {"request": rid, "instance": inst.id,
                                                                "tokens_sent": len(progress.sent), "error": e.message})
                    log.warning("unit %s: instance %s died under request %s after %d token(s); resuming elsewhere",
                                self.unit.name, inst.id, rid, len(progress.sent))
                    cur = seq.resumed(progress.sent)    # a grammar resumes where it was: the sent tokens replay into it
                finally:
                    if inst.meter is not None:
                        inst.meter.served(current_principal.get().tenant, time.monotonic() - placed_at)
                    inst.inflight -= 1
                    self.inflight -= 1
                    if self._placed.get(rid) is inst.backend:
                        self._placed.pop(rid, None)
                    if not self.inflight and not self.waiting:
                        self.idle_since = time.monotonic()
        except SitsError as e:
            if e.http_status >= 500 and e.code not in NOT_OUTCOMES:
                error_code = e.code
            raise
        finally:
            if primary:
                record_outcome(self.unit.breaker, self.unit.spec.slo.ttft_ms, progress, error_code, probe)

    def abort(self, request_id: str, error: SitsError | None = None) -> None:
        err = error or RequestAbortedError(f"request {request_id} was aborted")
        waiter = self._waiters.get(request_id)
        if waiter is not None and not waiter.done():
            waiter.set_result(err)
        backend = self._placed.get(request_id)
        if backend is not None:
            backend.abort(request_id, err)

    async def embed(self, inputs: list[list[int]]) -> np.ndarray:
        """Mean-pooled hidden states from one of this unit's instances (a cold unit starts one)."""
        rid = f"embed-{uuid.uuid4().hex[:12]}"
        probe = EngineRequest(rid, max(inputs, key=len), SamplingParams(max_tokens=1))
        self.idle_since = None
        inst, _ = await self.acquire(rid, probe, [], None)
        inst.inflight += 1
        self.inflight += 1
        try:
            return await inst.backend.embed(inputs)
        finally:
            inst.inflight -= 1
            self.inflight -= 1
            if not self.inflight and not self.waiting:
                self.idle_since = time.monotonic()
