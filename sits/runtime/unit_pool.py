"""A unit's instances: start, watch, replace, drain; and the wait for a READY one.

Instance states: STARTING (process spawned) → WARMING (imports done, loading weights and warming
up) → READY → DRAINING (no new requests; in-flight ones finish) → STOPPED. A READY instance whose
process dies is detected by its socket closing and by the health tick, marked STOPPED, and
replaced while the desired count says it should exist. Requests that find no READY instance wait
for one (the pool asks the autoscaler for a cold start at once); they never fail because of a cold
start. A start that fails is retried after an exponential backoff (``scale.start_backoff_s``,
doubling up to ``start_backoff_max_s``); while the last start failed and none is under way, a
request gets ``unit_unavailable`` at once, naming the cause, instead of waiting for a start that
is not coming.
"""

from __future__ import annotations

import asyncio
import enum
import itertools
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

from sits.engine.errors import SitsError
from sits.engine.messages import EngineLimits
from sits.engine.tokenizer import Tokenizer
from sits.runtime.cpu_quota import CpuQuotaManager, thread_cap
from sits.runtime.instance_client import InstanceBackend
from sits.runtime.unit_spec import UnitSpec
from sits.tenancy.instance_meter import InstanceMeter

log = logging.getLogger("sits.runtime")


class InstanceState(str, enum.Enum):
    STARTING = "STARTING"
    WARMING = "WARMING"
    READY = "READY"
    DRAINING = "DRAINING"
    STOPPED = "STOPPED"


@dataclass
class Instance:
    id: str
    unit: str
    state: InstanceState = InstanceState.STARTING
    backend: InstanceBackend | None = None
    pid: int | None = None
    requested_at: float = field(default_factory=time.monotonic)
    ready_at: float | None = None
    inflight: int = 0
    report: dict = field(default_factory=dict)     # phases_ms incl. spawn; set when READY
    error: str | None = None
    task: asyncio.Task | None = None
    quota: dict | None = None                      # the CpuQuota applied to its process, if any
    node: str | None = None                        # the Ray node it runs on (None: this host)
    meter: InstanceMeter | None = None             # its memory-time, apportioned to the tenants it serves
    cold_start_claimed: bool = False               # a request that waited for this start was charged it

    def cold_start(self) -> dict:
        """The start's phases; ``first_token`` (and a background KV touch) join once they happened."""
        phases = dict(self.report.get("phases_ms", {}))
        if self.backend is not None and self.backend.ready:
            for k, v in (self.backend.stats().cold_start.get("phases_ms") or {}).items():
                if k in ("first_token", "kv_touch_background"):
                    phases[k] = v
        return {"phases_ms": phases, "total_ms": self.report.get("total_ms")}

    def view(self) -> dict:
        cs = self.cold_start()
        return {"id": self.id, "state": self.state.value, "pid": self.pid, "node": self.node, "inflight": self.inflight,
                "cold_start_ms": cs["phases_ms"], "total_ms": cs["total_ms"], "error": self.error,
                "cpu_quota": self.quota}


class UnitUnavailableError(SitsError):
    """The unit's instances fail to start; the message names the cause, Retry-After the next try."""

    code = "unit_unavailable"
    http_status = 503


_quota_manager: CpuQuotaManager | None = None


def quota_manager() -> CpuQuotaManager:
    """One per process: it owns the ``sits`` cgroup parent."""
    global _quota_manager
    if _quota_manager is None:
        _quota_manager = CpuQuotaManager()
    return _quota_manager


class UnitPool:
    def __init__(self, spec: UnitSpec, *, on_event: Callable[[str, dict], None] | None = None,
                 launcher: Callable[[], object | None] | None = None, tokenizer: Tokenizer | None = None,
                 limits: EngineLimits | None = None, footprint_bytes: int = 0,
                 on_stopped: Callable[[Instance], None] | None = None,
                 reserve_memory: Callable[[Instance], Awaitable[None]] | None = None,
                 release_memory: Callable[[Instance], None] | None = None):
        """``launcher()`` returns the current instance launcher (the zygote's fork) or None (fresh process);
        ``tokenizer``: the unit's, shared by its instances' front-end sides (not reloaded per start);
        ``limits``: what the unit validates requests against: an instance reporting others is not used."""
        self.spec = spec
        self.tokenizer = tokenizer
        self.limits = limits
        self.footprint_bytes = footprint_bytes      # weights + KV pool of one instance (memory accounting)
        self._on_stopped = on_stopped or (lambda inst: None)
        # a start waits for its memory first (the gateway's ledger; it may evict idle instances of other units)
        self._reserve_memory = reserve_memory
        self._release_memory = release_memory or (lambda inst: None)
        self._launcher = launcher or (lambda: None)
        self.instances: list[Instance] = []
        self.desired = 0
        self._ids = itertools.count(1)
        self._changed = asyncio.Event()
        self._on_event = on_event or (lambda kind, data: None)
        self.starts = 0
        self.crashes = 0
        self.last_report: dict = {}
        self.last_started: Instance | None = None
        self.health_timeout_s = spec.scale.health_timeout_s
        self.start_failures = 0                    # consecutive failed starts (0 once one succeeds)
        self.start_error: str | None = None        # the last failed start's cause
        self.next_start_at = 0.0                   # monotonic: no start before this (backoff)

    def _stopped(self, inst: Instance, error: str | None = None) -> None:
        if inst.state is not InstanceState.STOPPED:
            try:
                self._on_stopped(inst)
            finally:
                self._release_memory(inst)
        inst.state = InstanceState.STOPPED
        if error is not None:
            inst.error = error
        if inst.quota is not None and inst.quota.get("cgroup"):
            quota_manager().release(inst.id, tries=1)     # never sleeps on the event loop; reaped later

    def send_health_checks(self) -> None:
        if _quota_manager is not None:
            _quota_manager.reap()           # groups of instances that had not exited yet when stopped
        for inst in self.ready():
            inst.backend.ping()

    # -- views ----------------------------------------------------------------------------------------
    def ready(self) -> list[Instance]:
        return [i for i in self.instances if i.state is InstanceState.READY and i.backend is not None
                and i.backend.ready]

    def starting(self) -> list[Instance]:
        return [i for i in self.instances if i.state in (InstanceState.STARTING, InstanceState.WARMING)]

    def live(self) -> list[Instance]:
        """Instances that count towards the desired number (not draining, not stopped)."""
        return [i for i in self.instances if i.state in (InstanceState.STARTING, InstanceState.WARMING,
                                                         InstanceState.READY)]

    def _notify(self) -> None:
        ev, self._changed = self._changed, asyncio.Event()
        ev.set()

    # -- scaling --------------------------------------------------------------------------------------
    def scale_to(self, n: int, reason: str = "", *, urgent: bool = False) -> None:
        """``urgent``: a request is waiting for these instances, so they skip warm-up (measured: on a
        cold start the warm-up costs more than it saves the first request; see docs/benchmarks.md)."""
        self.desired = n
        self.reconcile(reason, urgent=urgent)

    def reconcile(self, reason: str = "", *, urgent: bool = False) -> None:
        """Start or drain instances until ``live`` matches ``desired``; drop dead ones."""
        self.check_health()
        live = self.live()
        if self.desired > len(live) and time.monotonic() < self.next_start_at:
            return                                 # backing off after a failed start
        for _ in range(self.desired - len(live)):
            self._start(reason, urgent=urgent and not self.ready())
        if len(live) > self.desired:
            # drain the ones that are least useful: still starting first, then the least loaded
            order = sorted(live, key=lambda i: (i.state is InstanceState.READY, i.inflight))
            for inst in order[:len(live) - self.desired]:
                self._drain(inst, reason)

    def check_health(self) -> None:
        """Dead processes, and live ones that stopped answering pings for ``health_timeout_s``
        (killed, then replaced like a crash)."""
        for inst in self.instances:
            b = inst.backend
            if inst.state is InstanceState.READY and b is not None and b.ready and \
                    b.unanswered_s > self.health_timeout_s:
                log.warning("unit %s: instance %s (pid %s) has not answered a health check for %.1fs; killing it",
                            self.spec.name, inst.id, inst.pid, b.unanswered_s)
                self._on_event("instance_unresponsive", {"instance": inst.id, "pid": inst.pid,
                                                         "unanswered_s": round(b.unanswered_s, 2)})
                b.proc.kill()
                self._stopped(inst, "the instance stopped answering health checks")
                self.crashes += 1
                self._notify()
                continue
            if inst.state is InstanceState.READY and b is not None and not b.ready:
                self._stopped(inst, "the instance process died")
                self.crashes += 1
                log.warning("unit %s: instance %s (pid %s) died; replacing it", self.spec.name, inst.id, inst.pid)
                self._on_event("instance_crashed", {"instance": inst.id, "pid": inst.pid})
                self._notify()
        self.instances = [i for i in self.instances if i.state is not InstanceState.STOPPED]

    def _start(self, reason: str, urgent: bool = False) -> Instance:
        inst = Instance(f"{self.spec.name}-{next(self._ids)}", self.spec.name)
        self.instances.append(inst)
        self.starts += 1
        cfg = self.spec.engine_config()
        if self.spec.resources.cpu_quota is not None and cfg.threads is None:
            cfg.threads = thread_cap(self.spec.resources.cpu_quota)   # no more threads than the share
        if urgent:          # someone is waiting: no warm-up, KV pool faulted in while idle
            cfg.warmup = False
            cfg.kv_touch = "background"
        self._on_event("instance_starting", {"instance": inst.id, "reason": reason,
                                             "warmup": "skipped: a request is waiting" if urgent and
                                             self.spec.resources.warmup is not False else str(cfg.warmup_shapes
                                                                                               if cfg.warmup else False)})
        inst.task = asyncio.get_running_loop().create_task(self._run_start(inst, cfg), name=f"start-{inst.id}")
        return inst

    async def _run_start(self, inst: Instance, cfg) -> None:
        waited_from = time.monotonic()
        if self._reserve_memory is not None:
            try:
                await self._reserve_memory(inst)
            except asyncio.CancelledError:      # scaled down (or shut down) while it waited
                self._stopped(inst)
                raise
            except SitsError as e:               # it can never fit: a failed start, retried with backoff
                self._start_failed(inst, e.message)
                return
            if inst.state is InstanceState.DRAINING:       # scaled down while it waited for memory
                self._stopped(inst)
                self._notify()
                return
        t0 = time.monotonic()
        marks: dict[str, float] = {}

        def on_phase(phase: str, info: dict) -> None:
            marks[phase] = time.monotonic()
            if phase == "spawned":
                inst.pid = info.get("pid")
                inst.node = info.get("node")
                cpus = self.spec.resources.cpu_quota
                if cpus is not None and inst.pid and inst.node is None:    # Ray accounts for a node's CPUs
                    inst.quota = quota_manager().apply(inst.pid, cpus, inst.id).to_dict()
            if phase == "loading" and inst.state is InstanceState.STARTING:
                inst.state = InstanceState.WARMING

        launcher = self._launcher()
        how = "fork" if launcher is not None else "spawn"
        if getattr(launcher, "places", False):
            how = "place_and_fork"          # Ray placement on a node, then that node's zygote forks
        try:
            backend = await InstanceBackend.spawn(cfg, self.spec.name, on_phase=on_phase,
                                                  launcher=launcher, tokenizer=self.tokenizer)
            if self.limits is not None and backend.limits != self.limits:
                await backend.shutdown()
                raise SitsError(f"the instance's limits {backend.limits} differ from the unit's {self.limits}, "
                                "which its requests are validated against", code="limits_mismatch")
        except Exception as e:  # noqa: BLE001 - a failed start is reported and retried by reconcile
            self._start_failed(inst, getattr(e, "message", None) or f"{type(e).__name__}: {e}")
            return
        self.start_failures = 0
        self.start_error = None
        if inst.state is InstanceState.DRAINING:       # scaled down while it was starting
            await backend.shutdown()
            self._stopped(inst)
            self._notify()
            return
        inst.backend = backend
        if getattr(backend.proc, "standby", False):
            how = "standby"                 # handed to a process standing by (its device already set up)
        # fork/spawn/standby: request -> the process answering (interpreter start and imports included)
        phases = {how: round((marks.get("loading", t0) - t0) * 1e3, 2)}
        if t0 - waited_from > 0.001:         # waited for memory (idle instances of other units evicted)
            phases = {"memory_wait": round((t0 - waited_from) * 1e3, 2), **phases}
        phases.update(backend.cold_start.get("phases_ms", {}))
        inst.report = {"phases_ms": phases, "total_ms": round((time.monotonic() - t0) * 1e3, 2)}
        self.last_report = inst.report
        self.last_started = inst
        inst.state = InstanceState.READY
        inst.ready_at = time.monotonic()
        inst.meter = InstanceMeter(self.footprint_bytes, inst.requested_at)
        log.info("unit %s: instance %s READY in %.0f ms %s", self.spec.name, inst.id, inst.report["total_ms"],
                 phases)
        self._on_event("instance_ready", {"instance": inst.id, "cold_start": inst.report})
        self._notify()

    def _start_failed(self, inst: Instance, error: str) -> None:
        """Report a failed start; the next one waits out a backoff that doubles per failure in a row."""
        self._stopped(inst, error)
        self.start_failures += 1
        self.start_error = inst.error
        wait = min(self.spec.scale.start_backoff_s * 2 ** (self.start_failures - 1),
                   self.spec.scale.start_backoff_max_s)
        self.next_start_at = time.monotonic() + wait
        log.error("unit %s: instance %s failed to start (%d in a row; next try in %.1f s): %s",
                  self.spec.name, inst.id, self.start_failures, wait, inst.error)
        self._on_event("instance_failed", {"instance": inst.id, "error": inst.error,
                                           "failures_in_a_row": self.start_failures, "retry_in_s": wait})
        self._notify()

    def evict(self, inst: Instance, reason: str) -> None:
        """Drain this idle instance and want one fewer (its memory is needed by another unit)."""
        self.desired = max(0, self.desired - 1)
        self._drain(inst, reason)

    def _drain(self, inst: Instance, reason: str) -> None:
        prev = inst.state
        inst.state = InstanceState.DRAINING
        self._on_event("instance_draining", {"instance": inst.id, "reason": reason})
        if prev is InstanceState.READY:
            asyncio.get_running_loop().create_task(self._finish_drain(inst))

    async def _finish_drain(self, inst: Instance, grace_s: float = 30.0) -> None:
        deadline = time.monotonic() + grace_s
        while inst.inflight and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        if inst.backend is not None:
            await inst.backend.shutdown()
        self._stopped(inst)
        self._on_event("instance_stopped", {"instance": inst.id})
        self._notify()

    # -- requests -------------------------------------------------------------------------------------
    async def acquire(self, on_wait: Callable[[], None] | None = None,
                      choose: Callable[[list[Instance]], Instance] | None = None) -> Instance:
        """A READY instance (``choose`` picks among them; default the least loaded); waits while there is none."""
        asked = False
        while True:
            self.check_health()
            ready = self.ready()
            if ready:
                return choose(ready) if choose is not None else min(ready, key=lambda i: i.inflight)
            if not asked and on_wait is not None:
                on_wait()
                asked = True
            if self.start_failures and not self.starting():
                raise self.unavailable()
            await self._changed.wait()

    def unavailable(self) -> UnitUnavailableError:
        """Why a request cannot be served now: the last start's failure, and when the next try is."""
        wait = max(0.0, self.next_start_at - time.monotonic())
        err = UnitUnavailableError(
            f"unit {self.spec.name} cannot start an instance ({self.start_failures} failed start(s) in a row; "
            f"next try in {wait:.1f} s): {self.start_error}", param="model")
        err.retry_after_s = max(1, round(wait))
        return err

    def failure_view(self) -> dict | None:
        """The unit's start failures for its status, or None while starts succeed."""
        if not self.start_failures:
            return None
        return {"failures_in_a_row": self.start_failures, "error": self.start_error,
                "retry_in_s": round(max(0.0, self.next_start_at - time.monotonic()), 2)}

    async def shutdown(self) -> None:
        self.desired = 0
        tasks = [i.task for i in self.instances if i.task is not None and not i.task.done()]
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for inst in self.instances:
            if inst.backend is not None and inst.state is not InstanceState.STOPPED:
                await inst.backend.shutdown()
            self._stopped(inst)
        self.instances = []

    def last_cold_start(self) -> dict:
        """The most recent start's report (with its first token once served)."""
        inst = self.last_started
        if inst is not None and inst.state is InstanceState.READY:
            return inst.cold_start()
        return self.last_report
