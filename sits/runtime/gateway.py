"""The gateway: deployed units, each an instance pool behind the HTTP layer's Backend API.

``UnitBackend`` is what the OpenAI and SITS dialects see for a unit: it validates and tokenizes in
the gateway (with the unit's tokenizer, loaded at deploy time, so a unit at zero instances still
answers 4xx for bad input at once), waits for a READY instance when there is none (a cold start
is requested immediately, not at the next autoscaler tick), then streams from the least loaded
instance. ``Gateway`` owns the units, persists them (``UnitStore``), and runs the autoscaler loop:
one decision per unit per tick, every change an event with its reason.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import logging
import os
import time
import uuid
from dataclasses import asdict, dataclass, field, replace
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Protocol

import numpy as np

from sits.engine.config import ModelConfig, generation_defaults
from sits.engine.errors import EngineDeadError, InvalidRequestError, ModelLoadError, RequestAbortedError, SitsError
from sits.engine.messages import EngineRequest, EngineStats, TokenEvent
from sits.engine.request_validator import RequestValidator, plan_limits
from sits.engine.sampling_params import SamplingParams
from sits.engine.tokenizer import Tokenizer
from sits.faults import FaultInjector, FaultsSpec
from sits.memory.ingest import ingest_dir
from sits.memory.vectors import EmbedderUnavailableError, off_loop, open_memory_store
from sits.observe import tracing
from sits.runtime.autoscaler import Autoscaler, ScaleDecision
from sits.runtime.sla import NOT_OUTCOMES, BreakerState, SlaBreaker, SlaBreakerOpenError
from sits.runtime.unit_metrics import CpuMeter, MetricsWindow
from sits.runtime.unit_pool import UnitPool
from sits.runtime.unit_spec import UnitSpec
from sits.runtime.features import DEFAULT_MEMORY_TOP_K, BackendFeatures
from sits.runtime.hints import RequestHints
from sits.runtime.host_fit import check_fits_host
from sits.runtime.prefetch import Prefetcher
from sits.runtime.router import Router, prefix_hashes
from sits.runtime.unit_store import UnitStore
from sits.runtime.zygote import ZygoteClient

log = logging.getLogger("sits.runtime")

MAX_FAILOVERS = 3      # a request that kills this many instances is not retried further


class UnitHost(Protocol):
    """What a unit needs from the gateway that runs it (``Gateway`` is one): somewhere to report what
    happened, its fallback, a way to ask for an autoscaler run now, and how instances start."""

    def record(self, unit: str, kind: str, data: dict) -> None: ...

    def unit(self, name: str) -> "UnitBackend | None": ...

    def kick(self, name: str) -> None: ...

    def observe_call(self, unit: str, hints: RequestHints) -> None: ...

    def launcher(self): ...


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


class UnitBackend:
    def __init__(self, spec: UnitSpec, host: "UnitHost"):
        self.spec = spec
        self.name = spec.name
        self.root = spec.model
        self.created = int(time.time())
        if not os.path.isdir(spec.model):
            raise InvalidRequestError(f"unit {spec.name}: model directory {spec.model} does not exist",
                                      param="model", code="model_dir_not_found")
        try:
            mc = ModelConfig.from_dir(spec.model)
            self.tokenizer = Tokenizer.from_dir(spec.model)
        except ModelLoadError as e:      # a unit that cannot load is the deployer's input error
            raise InvalidRequestError(f"unit {spec.name}: {e.message}", param="model", code=e.code) from None
        check_fits_host(spec, mc)
        # what every instance of this unit will report in its Ready (checked there): requests are
        # validated once, here, against them
        self.limits = plan_limits(spec.engine_config(), mc)
        self.max_model_len = self.limits.max_model_len
        self.validator = RequestValidator(self.tokenizer, self.limits)
        self.kv_capacity_tokens = self.limits.kv_capacity_tokens
        self.ingested: dict | None = None
        self.features = BackendFeatures(
            ttft_slo_ms=spec.slo.ttft_ms, tools=tuple(spec.tools), tool_dirs=dict(spec.tool_dirs),
            python_tools=spec.python_tools, memory_set=spec.memory.set if spec.memory else None,
            memory_top_k=spec.memory.top_k if spec.memory else DEFAULT_MEMORY_TOP_K)
        self.sampling_defaults = generation_defaults(spec.model)
        self.host = host
        self.pool = UnitPool(spec, on_event=lambda kind, data: host.record(spec.name, kind, data),
                             launcher=host.launcher, tokenizer=self.tokenizer, limits=self.limits)
        self.autoscaler = Autoscaler(spec.scale, spec.slo)
        self.router = Router()
        self.routed: collections.Counter = collections.Counter()
        self.window = MetricsWindow(spec.scale.window_s)
        self.cpu = CpuMeter()
        self.waiting = 0
        self.inflight = 0
        self.idle_since: float | None = time.monotonic()
        self.last_decision: ScaleDecision | None = None
        self._waiters: dict[str, asyncio.Future] = {}
        self._placed: dict[str, object] = {}      # request id -> instance backend serving it
        self.breaker = SlaBreaker(spec.sla, spec.slo.ttft_ms, on_transition=self._breaker_moved)
        self.fallbacks = 0                        # requests sent to the fallback unit while open
        self.faults = FaultInjector(spec.faults or FaultsSpec())
        self._directed: dict[str, object] = {}    # instance id -> the fault directives it was sent
        self._past_fault_hits: collections.Counter = collections.Counter()

    @property
    def fault_hits(self) -> collections.Counter:
        """Times each fault kind acted on this unit, over every fault set it had (for metrics)."""
        return self._past_fault_hits + self.faults.hits

    # -- the SLA guard and faults ---------------------------------------------------------------------
    def _breaker_moved(self, frm: BreakerState, to: BreakerState, why: str) -> None:
        self.host.record(self.name, "breaker", {"from": frm.value, "to": to.value, "reason": why})
        (log.warning if to is BreakerState.OPEN else log.info)("unit %s: SLA breaker %s -> %s (%s)",
                                                                self.name, frm.value, to.value, why)

    def admit(self) -> "UnitBackend":
        """This unit if its breaker lets the request through, else its fallback unit, else a fast 503."""
        if self.breaker.admits():
            return self
        self.breaker.rejected += 1
        fb = self.host.unit(self.spec.fallback) if self.spec.fallback else None
        if fb is not None and fb is not self and fb.breaker.admits():
            self.fallbacks += 1
            return fb
        err = SlaBreakerOpenError(
            f"unit {self.name} is shedding load: its SLA breaker is open (success rate below "
            f"{self.spec.sla.success_rate:g} over the last {self.spec.sla.window_s:g}s)"
            + ("" if not self.spec.fallback else f" and its fallback {self.spec.fallback!r} cannot take it"),
            param="model")
        err.retry_after_s = self.breaker.retry_after_s()
        raise err

    def set_faults(self, spec: FaultsSpec | None) -> None:
        """Replace this unit's faults (admin endpoint); instances get the new directives at once."""
        self._past_fault_hits.update(self.faults.hits)
        self.faults = FaultInjector(spec or FaultsSpec())
        self.host.record(self.name, "faults", {"inject": [f.kind for f in self.faults.spec.inject],
                                                  "enabled": self.faults.spec.enabled, "seed": self.faults.spec.seed})
        self.direct_instances()

    def direct_instances(self) -> None:
        """Send each READY instance its fault directives when they changed (none: an empty set)."""
        ready = self.pool.ready()
        for gone in set(self._directed) - {i.id for i in ready}:
            del self._directed[gone]
        for inst in ready:
            d = self.faults.directives_for(inst.id)
            if self._directed.get(inst.id) != d:
                if not (d.empty and inst.id not in self._directed):
                    inst.backend.send_directives(d.to_dict())
                    if not d.empty:
                        self.host.record(self.name, "fault_directives", {"instance": inst.id, **d.to_dict()})
                self._directed[inst.id] = d

    # -- the Backend API ------------------------------------------------------------------------------
    @property
    def ready(self) -> bool:
        return True      # a unit accepts requests at any scale; a cold one makes them wait

    def prepare(self, prompt: str | list[int], params: SamplingParams, *, request_id: str, priority: int = 0,
                interactive: bool = True, add_special_tokens: bool = True) -> EngineRequest:
        if isinstance(prompt, str) and self.spec.prompt_template is not None:
            prompt = self.spec.render_prompt(prompt)
        ids = self.validator.prompt_ids(prompt, params, priority, add_special_tokens=add_special_tokens)
        if request_id in self._placed or request_id in self._waiters:
            raise InvalidRequestError(f"request id {request_id!r} is already in use", param="request_id",
                                      code="duplicate_request_id")
        return EngineRequest(request_id, ids, params, priority, interactive)

    async def _acquire(self, rid: str, seq: EngineRequest, hashes: list[int], session_id: str | None, lag_s: float = 0.0):
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
                return await self.pool.acquire(on_wait=lambda: self.host.kick(self.name), choose=choose)

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
                              attributes={"sits.unit": self.name, "sits.instance": inst.id,
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
        self.window.arrival()
        self.idle_since = None
        primary = seq.request_id.endswith("-0")
        probe = self.breaker.probe_started() if primary else None
        error_code: str | None = None
        rid = seq.request_id
        progress = StreamProgress(seq)
        failovers = 0
        cur = seq
        hints = hints or RequestHints()
        self.host.observe_call(self.name, hints)
        hashes = prefix_hashes(seq.prompt_token_ids)
        faults = self.faults
        lag = faults.queue_lag_s(hints.path) if faults.active else 0.0
        hold_first = faults.first_frame_s(hints.path) if faults.active else 0.0
        try:
            while True:
                t_route = seq.arrival_time if not failovers else time.monotonic()   # gateway queueing included
                inst, why = await self._acquire(rid, cur, hashes, hints.session_id, lag)
                lag = 0.0
                self._trace_route(t_route, inst, why, failovers)
                self.router.record(inst.id, hashes, hints.session_id)
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
                            self.window.finished(progress.ttft_ms, (ev.time - ev.arrival_time) * 1e3,
                                                 ev.num_output_tokens, progress.itls)
                        yield ev
                    return
                except EngineDeadError as e:
                    if failovers >= MAX_FAILOVERS or progress.left <= 0:
                        raise
                    failovers += 1
                    self.host.record(self.name, "failover", {"request": rid, "instance": inst.id,
                                                                "tokens_sent": len(progress.sent), "error": e.message})
                    log.warning("unit %s: instance %s died under request %s after %d token(s); resuming elsewhere",
                                self.name, inst.id, rid, len(progress.sent))
                    cur = seq.resumed(progress.sent)    # a grammar resumes where it was: the sent tokens replay into it
                finally:
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
                self._record_outcome(progress, error_code, probe)

    def _record_outcome(self, progress: "StreamProgress", error_code: str | None, probe) -> None:
        """The request's one outcome for the SLA breaker (see ``stream``)."""
        waited_ms = progress.gateway_ttft_ms
        if waited_ms is None:
            waited_ms = (time.monotonic() - progress.request.arrival_time) * 1e3
        if progress.finished or error_code is not None:
            self.breaker.record(self.breaker.classify(progress.gateway_ttft_ms, error_code), probe=probe)
        elif waited_ms > self.spec.slo.ttft_ms:      # abandoned or cut short after the SLO had passed
            self.breaker.record(self.breaker.classify(waited_ms, None), probe=probe)
        else:
            self.breaker.probe_cancelled(probe)

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
        inst, _ = await self._acquire(rid, probe, [], None)
        inst.inflight += 1
        self.inflight += 1
        try:
            return await inst.backend.embed(inputs)
        finally:
            inst.inflight -= 1
            self.inflight -= 1
            if not self.inflight and not self.waiting:
                self.idle_since = time.monotonic()

    def session_instance(self, session_id: str) -> str | None:
        """Where the session's last request ran (recorded in the session for affinity)."""
        return self.router.instance_of(session_id)

    def stats(self) -> EngineStats:
        return self._aggregate([i.backend.stats() for i in self.pool.ready()])

    def _aggregate(self, ready: list[EngineStats]) -> EngineStats:
        if not ready:
            return EngineStats(self.waiting, 0, 0.0, 0, 0, 0, 0, 0.0, 0, 0, self.spec.resources.policy,
                               self.pool.last_cold_start())
        blocks = sum(s.num_kv_blocks for s in ready)
        free = sum(s.num_free_blocks for s in ready)
        queries = sum(s.prefix_queries for s in ready)
        hits = sum(s.prefix_hits for s in ready)
        return EngineStats(sum(s.num_waiting for s in ready) + self.waiting, sum(s.num_running for s in ready),
                           1.0 - free / blocks if blocks else 0.0, blocks, free, queries, hits,
                           hits / queries if queries else 0.0, sum(s.num_preemptions for s in ready),
                           sum(s.num_steps for s in ready), self.spec.resources.policy,
                           self.pool.last_cold_start())

    # -- scaling --------------------------------------------------------------------------------------
    def tick(self, now: float) -> ScaleDecision:
        ready = self.pool.ready()
        per = [i.backend.stats() for i in ready]
        st = self._aggregate(per)
        cpu = self.cpu.read([i.pid for i in ready if i.pid])
        gpus = [s.gpu_util for s in per if s.gpu_util is not None]
        m = self.window.snapshot(queue_depth=st.num_waiting, inflight=self.inflight, cpu_util=cpu,
                                 gpu_util=sum(gpus) / len(gpus) if gpus else None,
                                 kv_util=st.kv_usage if st.num_kv_blocks else None)
        d = self.autoscaler.decide(m, current=self.pool.desired, starting=len(self.pool.starting()), now=now,
                                   idle_since=self.idle_since)
        self.last_decision = d
        if d.target != self.pool.desired:
            self.host.record(self.name, "scale", {"from": d.current, "to": d.target, "reason": d.reason,
                                                     "slo_health": d.health, "direction": d.direction})
            log.info("unit %s: scale %d -> %d (%s)", self.name, d.current, d.target, d.reason)
            self.pool.scale_to(d.target, d.reason, urgent=d.current == 0 and self.waiting > 0)
        else:
            self.pool.reconcile(d.reason)        # replaces crashed instances
        if self.faults.active or self._directed:
            self.direct_instances()
        return d

    def view(self) -> dict:
        d = self.last_decision
        m = self.window.snapshot(queue_depth=self.waiting, inflight=self.inflight)
        return {
            "name": self.name, "model": self.spec.model, "desired": self.pool.desired,
            "instances": [i.view() for i in self.pool.instances], "waiting": self.waiting, "inflight": self.inflight,
            "metrics": {"ttft_p95_ms": m.ttft_p95, "itl_p95_ms": m.itl_p95, "rps": round(m.rps, 3),
                        "tps": round(m.tps, 3)},
            "slo_health": d.health if d else None, "last_decision": None if d is None else
            {"from": d.current, "to": d.target, "reason": d.reason},
            "starts": self.pool.starts, "crashes": self.pool.crashes, "start_failure": self.pool.failure_view(),
            "routed": dict(self.routed),
            "cold_start": self.pool.last_cold_start(),
            "memory": None if self.spec.memory is None else {**self.spec.memory.model_dump(), "ingested": self.ingested},
            "sla": self.breaker.view() | {"fallback": self.spec.fallback, "fallbacks": self.fallbacks},
            "faults": self.faults.view() if self.faults.spec.inject else None,
            "spec": self.spec.model_dump(),
        }


def unit_embedder_name(unit: str) -> str:
    return f"unit:{unit}"


class _UnitEmbedder:
    """Vector memory's embedder for a unit's set: the unit's own model (mean-pooled hidden states),
    called from memory's worker threads and run on the gateway's event loop (a cold unit starts)."""

    TIMEOUT_S = 600.0

    def __init__(self, backend: "UnitBackend", loop: asyncio.AbstractEventLoop):
        self.backend, self.loop = backend, loop

    def __call__(self, texts: list[str]) -> np.ndarray:
        tok, limit = self.backend.tokenizer, self.backend.max_model_len
        ids = [(tok.encode(t) or [tok.eos_token_ids[0] if tok.eos_token_ids else 0])[:limit] for t in texts]
        fut = asyncio.run_coroutine_threadsafe(self.backend.embed(ids), self.loop)
        try:
            return fut.result(self.TIMEOUT_S)
        except concurrent.futures.TimeoutError:
            fut.cancel()
            raise EmbedderUnavailableError(f"unit {self.backend.name} gave no embeddings within "
                                           f"{self.TIMEOUT_S:g} s") from None


class Gateway:
    def __init__(self, data_dir: str | Path, *, tick_s: float = 1.0, zygote: bool = True,
                 prefetch: bool = True, prefetch_threshold: float = 0.85):
        self.data_dir = Path(data_dir)
        # vector memory of the data directory (RAG units ingest into it; the HTTP layer serves it)
        self.memory = open_memory_store(self.data_dir)
        self.use_zygote = zygote
        self.prefetcher = Prefetcher(threshold=prefetch_threshold if prefetch else float("inf"))
        self.zygote: ZygoteClient | None = None
        self.store = UnitStore(self.data_dir)
        self.units: dict[str, UnitBackend] = {}
        self.tick_s = tick_s
        self.events: collections.deque[dict] = collections.deque(maxlen=1000)
        self.decisions: collections.Counter = collections.Counter()
        self.breaker_transitions: collections.Counter = collections.Counter()   # (unit, to state) -> n
        self._loop_task: asyncio.Task | None = None

    def launcher(self):
        """How instances start now: forked from the zygote while it lives, else a fresh interpreter."""
        z = self.zygote
        return z.fork if z is not None and z.alive else None

    def observe_call(self, unit: str, hints) -> None:
        """A call of ``unit``: learn the chain, and start the units that likely come next (pre-warming)."""
        for nxt, p in self.prefetcher.observe(unit, hints.chain_key):
            b = self.units.get(nxt)
            if b is None or b.pool.ready() or b.pool.starting() or b.pool.desired >= b.spec.scale.max_instances:
                continue
            reason = f"prefetch: P({nxt} | {unit}) = {p:.2f} >= {self.prefetcher.threshold:g}"
            self.record(nxt, "prefetch", {"after": unit, "p": round(p, 3)})
            self.record(nxt, "scale", {"from": b.pool.desired, "to": b.pool.desired + 1, "reason": reason,
                                       "direction": "up"})
            b.idle_since = time.monotonic()           # keep-alive counts from the pre-warm
            b.autoscaler.state.calm_since = time.monotonic()
            b.pool.scale_to(b.pool.desired + 1, reason)

    def unit(self, name: str) -> UnitBackend | None:
        return self.units.get(name)

    def record(self, unit: str, kind: str, data: dict) -> None:
        """The one way units tell the gateway what happened: kept in the event log, and counted for
        metrics (autoscaler decisions, breaker transitions) from the events themselves."""
        self.events.append({"time": time.time(), "unit": unit, "event": kind, **data})
        if kind == "scale" and data.get("direction"):
            self.decisions[(unit, data["direction"])] += 1
        elif kind == "breaker":
            self.breaker_transitions[(unit, data["to"])] += 1

    # -- units ----------------------------------------------------------------------------------------
    async def deploy(self, spec: UnitSpec, *, persist: bool = True) -> UnitBackend:
        old = self.units.get(spec.name)
        backend = await asyncio.to_thread(UnitBackend, spec, self)
        # a set embedded by the unit's own model can only be ingested once the unit can run
        own_embedder = spec.memory is not None and spec.memory.embedder == "unit"
        if not own_embedder:
            await self._ingest(backend)
        if old is not None:
            await self.undeploy(spec.name, persist=False)
        self.units[spec.name] = backend
        if self.zygote is not None and self.zygote.alive:
            self.zygote.preload(asdict(spec.engine_config()))
        backend.tick(time.monotonic())           # min_instances start now
        if own_embedder:
            self.memory.register_embedder(unit_embedder_name(spec.name),
                                          _UnitEmbedder(backend, asyncio.get_running_loop()))
            try:
                await self._ingest(backend)
            except SitsError:
                await self.undeploy(spec.name, persist=False)
                raise
        if persist:
            self.store.put(spec)
        self.record(spec.name, "deployed", {"model": spec.model})
        return backend

    async def _ingest(self, backend: UnitBackend) -> None:
        mem = backend.spec.memory
        if mem is None or not mem.ingest:
            return
        embedder = unit_embedder_name(backend.name) if mem.embedder == "unit" else None
        try:
            backend.ingested = await off_loop(ingest_dir, self.memory, mem.set, mem.ingest,
                                                       mem.chunk_chars, embedder=embedder)
        except OSError as e:
            raise InvalidRequestError(f"unit {backend.name}: memory.ingest: {e}", param="memory.ingest",
                                      code="ingest_failed") from None
        self.record(backend.name, "ingested", backend.ingested)

    async def undeploy(self, name: str, *, persist: bool = True) -> bool:
        backend = self.units.pop(name, None)
        self.memory.register_embedder(unit_embedder_name(name), None)
        if persist:
            self.store.delete(name)
        if backend is None:
            return False
        for rid in list(backend._waiters):
            backend.abort(rid, SitsError(f"unit {name} was deleted", code="unit_deleted"))
        await backend.pool.shutdown()
        self.record(name, "deleted", {})
        return True

    def scale(self, name: str, n: int) -> UnitBackend:
        backend = self.units[name]
        hi = backend.spec.scale.max_instances
        if not 0 <= n <= hi:
            raise InvalidRequestError(f"unit {name} scales within [0, {hi}] (max_instances); got {n}",
                                      param="instances", code="invalid_parameter")
        backend.pool.scale_to(n, "manual scale")
        backend.autoscaler.state.calm_since = time.monotonic()     # a manual scale-up is not undone at once
        self.record(name, "scale", {"from": None, "to": n, "reason": "manual scale"})
        return backend

    def kick(self, name: str) -> None:
        """Run the autoscaler for this unit now (a request is waiting for a cold unit)."""
        backend = self.units.get(name)
        if backend is not None:
            backend.tick(time.monotonic())

    # -- lifecycle ------------------------------------------------------------------------------------
    async def start(self, config_units: list[UnitSpec]) -> None:
        """Start the zygote; deploy the persisted units, then the config's (which win on a name clash); tick."""
        if self.use_zygote:
            try:
                self.zygote = await ZygoteClient.start()
                self.record("", "zygote_ready", {"pid": self.zygote.info["pid"],
                                                 "preload_ms": self.zygote.info["preload_ms"]})
            except Exception as e:  # noqa: BLE001 - instances still start, from fresh interpreters
                log.error("zygote failed to start (%s); instances will start from fresh processes", e)
        by_name = {u.name: u for u in self.store.all()}
        for u in config_units:
            by_name[u.name] = u
            self.store.put(u)
        for spec in by_name.values():
            try:
                await self.deploy(spec, persist=False)
            except SitsError as e:
                log.error("unit %s not deployed: %s", spec.name, e.message)
                self.record(spec.name, "deploy_failed", {"error": e.message})
        self._loop_task = asyncio.get_running_loop().create_task(self._autoscale_loop(), name="autoscaler")

    async def _autoscale_loop(self) -> None:
        while True:
            await asyncio.sleep(self.tick_s)
            now = time.monotonic()
            for backend in list(self.units.values()):
                try:
                    backend.pool.send_health_checks()
                    backend.tick(now)
                except Exception:  # noqa: BLE001 - one unit's bug must not stop the others' scaling
                    log.exception("autoscaler tick for %s failed", backend.name)

    async def shutdown(self) -> None:
        if self._loop_task is not None:
            self._loop_task.cancel()
        for name in list(self.units):
            backend = self.units.pop(name)
            await backend.pool.shutdown()
        if self.zygote is not None:
            await self.zygote.shutdown()
        self.store.close()
        self.memory.close()

    def status(self) -> dict:
        return {"units": [b.view() for b in self.units.values()], "events": list(self.events)[-50:]}
