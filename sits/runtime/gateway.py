"""The gateway: the deployed units (``unit.UnitBackend``, each an instance pool behind the HTTP
layer's Backend API, with a ``dispatcher.UnitDispatcher`` choosing the instance for each request).

``Gateway`` owns the units, persists them (``UnitStore``), runs the autoscaler loop (one decision
per unit per tick, every change an event with its reason), keeps the event log every unit reports
to (``UnitHost.record``), pre-warms units that usually come next, and the zygote instances fork from.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import logging
import time
from dataclasses import asdict
from pathlib import Path
from typing import Protocol

import numpy as np

from sits.engine.errors import InvalidRequestError, SitsError
from sits.memory.ingest import ingest_dir
from sits.memory.vectors import EmbedderUnavailableError, off_loop, open_memory_store
from sits.runtime.host_fit import available_memory_bytes
from sits.runtime.device_memory import CUDA_CONTEXT_BYTES, gpu_memory
from sits.runtime.memory_ledger import MemoryLedger
from sits.runtime.unit_spec import UnitSpec
from sits.runtime.hints import RequestHints
from sits.runtime.prefetch import Prefetcher
from sits.runtime.unit_store import UnitStore
from sits.runtime.unit import UnitBackend
from sits.runtime.mesh_unit import MeshUnit
from sits.runtime.remote_unit import RemoteUnit
from sits.runtime.zygote import ZygoteClient, weights_key
from sits.runtime.finetune_jobs import FinetuneJobs
from sits.tenancy.service import Tenancy

log = logging.getLogger("sits.runtime")

class UnitHost(Protocol):
    """What a unit needs from the gateway that runs it (``Gateway`` is one): somewhere to report what
    happened, its fallback, a way to ask for an autoscaler run now, and how instances start."""

    def record(self, unit: str, kind: str, data: dict) -> None: ...

    def unit(self, name: str) -> "UnitBackend | RemoteUnit | MeshUnit | None": ...

    def kick(self, name: str) -> None: ...

    def observe_call(self, unit: str, hints: RequestHints) -> None: ...

    def launcher(self, spec: UnitSpec | None = None, footprint_bytes: int = 0): ...

    async def reserve_memory(self, unit: "UnitBackend", inst) -> None: ...

    def release_memory(self, inst) -> None: ...

    tenancy: "Tenancy | None"      # where usage is recorded (instance memory-time), when tenants are kept


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


GPU_MEMORY_UTILIZATION = 0.9      # of each GPU's memory, what its instances may hold by default


class Gateway:
    def __init__(self, data_dir: str | Path, *, tick_s: float = 1.0, zygote: bool = True,
                 prefetch: bool = True, prefetch_threshold: float = 0.85, tenant_store: str | None = None,
                 ray: str | None = None, ray_placement_timeout_s: float = 60.0,
                 memory_budget_mb: float | None = None, gpu_memory_mb: float | None = None):
        """``ray``: place instances on a Ray cluster (``auto``, an address, or ``local`` for a one-node
        Ray started here) instead of forking them from this host's zygote. ``memory_budget_mb``: what
        this host's instances may hold together (default: the memory available when the gateway starts);
        ``gpu_memory_mb``: what the instances on each GPU may hold together (default: 90% of the
        device, or what NVML says is free when the gateway starts if less)."""
        self.data_dir = Path(data_dir)
        # vector memory of the data directory (RAG units ingest into it; the HTTP layer serves it)
        self.memory = open_memory_store(self.data_dir)
        # tenants, keys, usage (the app serves them and starts it); redis://... when gateways share them
        self.tenancy: Tenancy | None = Tenancy.open(self.data_dir, tenant_store)
        # fine-tuning jobs (kind: finetune): each trains in a process of its own, its adapter served when done
        self.finetune = FinetuneJobs(self.data_dir / "finetune", serve=self._serve_adapter)
        self.use_zygote = zygote
        self.prefetcher = Prefetcher(threshold=prefetch_threshold if prefetch else float("inf"))
        self.zygote: ZygoteClient | None = None
        self._standbys: dict[str, int] = {}          # device -> standby processes asked of the zygote
        self.ray_address = ray
        self.ray_placement_timeout_s = ray_placement_timeout_s
        self.cluster = None                     # RayCluster, with --ray
        self.memory_budget_mb = memory_budget_mb
        self.ledger: MemoryLedger | None = None     # this host's instances' memory (made at start)
        self.gpu_memory_mb = gpu_memory_mb
        self._gpus: dict[str, tuple[int, int]] = {}          # NVML at start: device -> (free, total) bytes
        self.device_ledgers: dict[str, MemoryLedger] = {}    # each GPU's instances' memory (made on first use)
        self.store = UnitStore(self.data_dir)
        self.units: dict[str, UnitBackend | RemoteUnit | MeshUnit] = {}
        self.tick_s = tick_s
        self.events: collections.deque[dict] = collections.deque(maxlen=1000)
        self.decisions: collections.Counter = collections.Counter()
        self.breaker_transitions: collections.Counter = collections.Counter()   # (unit, to state) -> n
        self._loop_task: asyncio.Task | None = None

    def launcher(self, spec: UnitSpec | None = None, footprint_bytes: int = 0):
        """How instances start now: placed on a Ray node by the unit's resources (``--ray``), forked
        from the zygote while it lives, else a fresh interpreter."""
        if self.cluster is not None and spec is not None:
            from sits.runtime.ray_cluster import Placement
            return self.cluster.launcher(Placement.of(spec, footprint_bytes))
        z = self.zygote
        return z.fork if z is not None and z.alive else None

    def observe_call(self, unit: str, hints) -> None:
        """A call of ``unit``: learn the chain, and start the units that likely come next (pre-warming)."""
        for nxt, p in self.prefetcher.observe(unit, hints.chain_key):
            b = self.units.get(nxt)
            if not isinstance(b, UnitBackend) or b.pool.ready() or b.pool.starting() or b.pool.desired >= b.spec.scale.max_instances:
                continue
            reason = f"prefetch: P({nxt} | {unit}) = {p:.2f} >= {self.prefetcher.threshold:g}"
            self.record(nxt, "prefetch", {"after": unit, "p": round(p, 3)})
            self.record(nxt, "scale", {"from": b.pool.desired, "to": b.pool.desired + 1, "reason": reason,
                                       "direction": "up"})
            b.dispatcher.idle_since = time.monotonic()     # keep-alive counts from the pre-warm
            b.autoscaler.state.calm_since = time.monotonic()
            b.pool.scale_to(b.pool.desired + 1, reason)

    def unit(self, name: str) -> UnitBackend | RemoteUnit | MeshUnit | None:
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
    async def deploy(self, spec: UnitSpec, *, persist: bool = True) -> UnitBackend | RemoteUnit | MeshUnit:
        self._refuse_mesh_cycle(spec)
        old = self.units.get(spec.name)
        if spec.kind == "remote":
            backend = RemoteUnit(spec, self)
        elif spec.kind == "mesh":
            backend = MeshUnit(spec, self)
        else:
            backend = await asyncio.to_thread(UnitBackend, spec, self)
            self._refuse_over_budget(backend)
        # a set embedded by the unit's own model can only be ingested once the unit can run
        own_embedder = spec.memory is not None and spec.memory.embedder == "unit"
        if not own_embedder:
            await self._ingest(backend)
        if old is not None:
            await self.undeploy(spec.name, persist=False)
        self.units[spec.name] = backend
        if spec.kind == "local" and self.cluster is not None:
            self.cluster.preload(self._node_config(spec))
        elif spec.kind == "local" and self.zygote is not None and self.zygote.alive:
            self._hold_preloaded(backend)
            self.zygote.preload(asdict(spec.engine_config()))
            self._sync_standbys()
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
        self.record(spec.name, "deployed", {"kind": spec.kind, "model": backend.root})
        return backend

    @staticmethod
    def _node_config(spec: UnitSpec) -> dict:
        """A unit's engine config as its instances get it on a Ray node (the device their placement
        gives them), so the node's zygote preloads the model those forks will look for."""
        from sits.runtime.ray_cluster import Placement
        return Placement.of(spec).engine_config(asdict(spec.engine_config()))

    def _sync_standbys(self) -> None:
        """The zygote keeps, per device, as many standby processes as the units on it ask for (the most)."""
        if self.zygote is None or not self.zygote.alive:
            return
        want: dict[str, int] = {}
        for u in self.units.values():
            if isinstance(u, UnitBackend):        # one set per device however its units spell it
                want[u.device] = max(want.get(u.device, 0), u.spec.standby_processes())
        for device in sorted(set(want) | set(self._standbys)):
            n = want.get(device, 0)
            if n == self._standbys.get(device, 0):
                continue
            self.zygote.standby(device, n)
            ledger = self.device_ledgers.get(device) if device.startswith("cuda") else None
            if ledger is not None:            # each standby holds a CUDA context on its GPU
                ledger.release(f"standby:{device}")
                if n:
                    ledger.hold(f"standby:{device}", None, n * CUDA_CONTEXT_BYTES, owner="(standby)")
        self._standbys = want

    def _refuse_mesh_cycle(self, spec: UnitSpec) -> None:
        """A mesh that would reach itself through its tiers (directly or via other meshes) is refused."""
        tiers = {n: list(u.spec.mesh.tiers) for n, u in self.units.items() if u.spec.mesh is not None}
        tiers[spec.name] = list(spec.mesh.tiers) if spec.mesh is not None else []
        path: list[str] = []

        def reaches_self(name: str) -> bool:
            for t in tiers.get(name, []):
                path.append(t)
                if t == spec.name or (t not in path[:-1] and reaches_self(t)):
                    return True
                path.pop()
            return False

        if reaches_self(spec.name):
            raise InvalidRequestError(f"unit {spec.name} would be a tier of itself: {' -> '.join([spec.name] + path)}",
                                      param="mesh.tiers", code="mesh_cycle")

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
        await backend.close(SitsError(f"unit {name} was deleted", code="unit_deleted"))
        if isinstance(backend, UnitBackend):
            self._release_preloaded(backend)
            self._sync_standbys()
        if self.cluster is not None and backend.spec.kind == "local":
            self.cluster.forget(self._node_config(backend.spec))
        self.record(name, "deleted", {})
        return True

    def scale(self, name: str, n: int) -> UnitBackend:
        backend = self.units[name]
        if not isinstance(backend, UnitBackend):
            raise InvalidRequestError(f"unit {name} is a {backend.spec.kind} unit ({backend.root}): it has no "
                                      "instances of its own to scale", param="name", code="unit_not_scalable")
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
    # -- memory ---------------------------------------------------------------------------------------
    def _ledger_for(self, unit: UnitBackend) -> MemoryLedger | None:
        """The ledger an instance of ``unit`` reserves from: the host's, or its GPU's (None: no budget,
        e.g. on a Ray cluster, whose nodes account for their own)."""
        if self.cluster is not None:
            return None
        if not unit.device.startswith("cuda"):
            return self.ledger
        ledger = self.device_ledgers.get(unit.device)
        if ledger is None:
            free_total = self._gpus.get(unit.device)
            if self.gpu_memory_mb is not None:
                capacity = int(self.gpu_memory_mb * 2**20)
            elif free_total is not None:       # 90% of the device, or what was free at start if less
                capacity = min(int(free_total[1] * GPU_MEMORY_UTILIZATION), free_total[0])
            else:
                return None                    # a GPU NVML does not show: not budgeted
            ledger = self.device_ledgers[unit.device] = MemoryLedger(capacity)
        return ledger

    async def reserve_memory(self, unit: UnitBackend, inst) -> None:
        """Before an instance of ``unit`` starts on this host: its memory (on the host, or on its GPU),
        or idle instances of other units there evicted for it, or a wait until some is given back (see
        ``memory_ledger``)."""
        ledger = self._ledger_for(unit)
        if ledger is None:
            return
        group = self._weights_group(unit) if ledger is self.ledger else None    # on a GPU each instance has its own
        weights = unit.weight_bytes + unit.device_reserve_bytes
        need = ledger.need(group, weights, unit.kv_bytes)
        where = f"GPU {unit.device}" if unit.device_reserve_bytes else "this host"
        if need > ledger.capacity - (ledger.held(group) if group else 0) - ledger.kept_by("(standby)"):
            raise SitsError(f"an instance of {unit.name} needs {need / 2**20:.0f} MiB and the instances on {where} "
                            f"may hold {ledger.capacity / 2**20:.0f} MiB in all", code="insufficient_memory")
        waiting = False
        while not ledger.reserve(inst.id, unit.name, group, weights, unit.kv_bytes):
            if inst.state.value == "DRAINING":       # not wanted any more
                return
            self._evict_idle(unit.name, need - (ledger.capacity - ledger.reserved), ledger)
            if not waiting:
                waiting = True
                self.record(unit.name, "instance_waiting_for_memory", {
                    "instance": inst.id, "device": unit.device, "need_mb": round(need / 2**20, 1), **ledger.view()})
            await ledger.freed(1.0)

    def release_memory(self, inst) -> None:
        for ledger in self._ledgers():
            ledger.release(inst.id)

    def _ledgers(self) -> list[MemoryLedger]:
        return [x for x in (self.ledger, *self.device_ledgers.values()) if x is not None]

    def _weights_group(self, unit: UnitBackend) -> str | None:
        """The weights the zygote keeps in host memory for ``unit`` (its preloaded model, shared by every
        fork: a CPU instance computes with it, a GPU instance copies it to its device), or None (no
        zygote: each instance loads its own copy; int8 on a GPU is quantized there)."""
        cfg = unit.spec.engine_config()
        if self.zygote is None or not self.zygote.alive or (unit.device_reserve_bytes and cfg.quantization):
            return None
        key = weights_key(asdict(cfg))
        return None if key is None else "weights:" + key

    def host_copy(self, unit: UnitBackend) -> dict | None:
        """The weights the zygote keeps for ``unit``: ``{"state": "loading"}`` while they are built (a GPU
        unit's by a loader process, seconds for a large model), then ``"ready"`` or ``"failed"`` (its
        instances load their own) with how long it took; None where none is kept."""
        if self.cluster is not None or self._weights_group(unit) is None:
            return None
        done = self.zygote.preload_state(asdict(unit.spec.engine_config()))
        if done is None:
            return {"state": "loading"}
        return {"state": "ready" if done["ok"] else "failed", "ms": done["ms"]}

    def _hold_preloaded(self, unit: UnitBackend) -> None:
        """The zygote keeps a deployed unit's weights in host memory (its forks share them): held in the
        host's ledger while a unit of that model is deployed, so a CPU instance's start reserves its KV
        pool only (a GPU instance reserves its own copy on its GPU's ledger)."""
        ledger, group = self.ledger, self._weights_group(unit)
        if ledger is None or group is None or ledger.holds(group):
            return
        short = ledger.reserved + unit.weight_bytes - ledger.capacity
        ledger.hold(group, group, unit.weight_bytes)
        if short > 0:       # instances give the rest back: idle ones now, busy ones when they stop
            self._evict_idle(unit.name, short, ledger)

    def _refuse_over_budget(self, unit: UnitBackend) -> None:
        """A unit whose weights and one instance's KV pool (on a GPU, with its activation reserve and
        CUDA context) cannot fit its ledger's budget beside what the zygote keeps for the other units
        (their preloaded weights; standby processes' contexts) is refused at deploy, with the numbers."""
        ledger = self._ledger_for(unit)
        if ledger is None:
            return
        group = self._weights_group(unit) if ledger is self.ledger else None
        held = ledger.kept - (ledger.held(group) if group is not None and ledger.holds(group) else 0)
        if ledger is not self.ledger:          # the standbys its deploy will ask for, if more than now
            held += max(0, unit.spec.standby_processes() * CUDA_CONTEXT_BYTES - ledger.held(f"standby:{unit.device}"))
            self._refuse_host_copy_over_budget(unit)
        need = unit.weight_bytes + unit.device_reserve_bytes + unit.kv_bytes
        if held + need > ledger.capacity:
            if unit.device_reserve_bytes:
                what = (f"GPU {unit.device}'s memory budget ({ledger.capacity / 2**20:.0f} MiB) beside the standby "
                        f"processes' contexts ({held / 2**20:.0f} MiB): raise --gpu-memory-mb")
            else:
                what = (f"this host's memory budget ({ledger.capacity / 2**20:.0f} MiB) beside the weights of the units "
                        f"deployed ({held / 2**20:.0f} MiB): raise --memory-budget-mb")
            raise InvalidRequestError(
                f"unit {unit.name}: its weights and one instance's KV pool ({need / 2**20:.0f} MiB) do not fit "
                f"{what} or make resources.kv_cache_mb smaller", param="resources", code="insufficient_memory")

    def _refuse_host_copy_over_budget(self, unit: UnitBackend) -> None:
        """A GPU unit's weights are kept in host memory by the zygote: they must fit the host's budget
        beside what it keeps already (unless another unit of that model keeps them there)."""
        ledger, group = self.ledger, self._weights_group(unit)
        if ledger is None or group is None or ledger.holds(group):
            return
        if ledger.kept + unit.weight_bytes > ledger.capacity:
            raise InvalidRequestError(
                f"unit {unit.name}: its weights ({unit.weight_bytes / 2**20:.0f} MiB), kept in host memory between its "
                f"GPU instances' starts, do not fit this host's memory budget ({ledger.capacity / 2**20:.0f} MiB) "
                f"beside what the zygote keeps ({ledger.kept / 2**20:.0f} MiB): raise --memory-budget-mb",
                param="resources", code="insufficient_memory")

    def _release_preloaded(self, unit: UnitBackend) -> None:
        """The last deployed unit of a weights group is gone: the zygote drops the model."""
        group = self._weights_group(unit)
        if group is None or any(isinstance(u, UnitBackend) and self._weights_group(u) == group
                                for u in self.units.values()):
            return
        if self.ledger is not None:
            self.ledger.release(group)
        self.zygote.forget(asdict(unit.spec.engine_config()))

    def _evict_idle(self, for_unit: str, shortfall: int, ledger: MemoryLedger) -> None:
        """Drain idle instances of other units that hold memory in ``ledger`` (nothing in flight or
        waiting; never below a unit's ``min_instances``), least recently used unit first, until what
        they hold, with what is being given back already, covers ``shortfall``."""
        local = [u for u in self.units.values() if isinstance(u, UnitBackend) and self._ledger_for(u) is ledger]
        freeing = sum(ledger.held(i.id) for u in local for i in u.pool.instances if i.state.value == "DRAINING")
        idle = [u for u in local if u.name != for_unit and u.dispatcher.inflight == 0 and u.dispatcher.waiting == 0
                and len(u.pool.live()) > u.spec.scale.min_instances]
        idle.sort(key=lambda u: u.dispatcher.idle_since or 0.0)
        for u in idle:
            for inst in u.pool.ready():
                if freeing >= shortfall or len(u.pool.live()) <= u.spec.scale.min_instances:
                    return
                if inst.inflight or not ledger.holds(inst.id):
                    continue
                n, freed = len(u.pool.live()), ledger.held(inst.id)
                reason = f"evicted: memory for {for_unit}"
                u.pool.evict(inst, reason)
                u.autoscaler.state.calm_since = time.monotonic()
                freeing += freed
                self.record(u.name, "scale", {"from": n, "to": n - 1, "reason": reason, "direction": "down"})
                self.record(u.name, "evicted", {"for": for_unit, "instance": inst.id, "freed_mb": round(freed / 2**20, 1)})

    async def start(self, config_units: list[UnitSpec]) -> None:
        """Start the zygote (or join the Ray cluster); deploy the persisted units, then the config's
        (which win on a name clash); tick."""
        if self.ray_address is not None:
            from sits.runtime.ray_cluster import RayCluster
            self.cluster = RayCluster(None if self.ray_address == "local" else self.ray_address,
                                      self.ray_placement_timeout_s)
            await self.cluster.start()
            self.record("", "ray_ready", {"nodes": self.cluster.view()})
        elif self.use_zygote:
            try:
                self.zygote = await ZygoteClient.start()
                self.record("", "zygote_ready", {"pid": self.zygote.info["pid"],
                                                 "preload_ms": self.zygote.info["preload_ms"]})
            except Exception as e:  # noqa: BLE001 - instances still start, from fresh interpreters
                log.error("zygote failed to start (%s); instances will start from fresh processes", e)
        # the default budget: what is available once the zygote (torch imported) is up
        budget = self.memory_budget_mb * 2**20 if self.memory_budget_mb is not None else available_memory_bytes()
        if budget is not None and self.cluster is None:
            self.ledger = MemoryLedger(int(budget))
        if self.cluster is None:
            self._gpus = await asyncio.to_thread(gpu_memory)
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
            if self.cluster is not None:
                self.cluster.refresh_soon()       # nodes that joined get a zygote, in the background
            for backend in list(self.units.values()):
                try:
                    if isinstance(backend, UnitBackend):
                        backend.pool.send_health_checks()
                    backend.tick(now)
                except Exception:  # noqa: BLE001 - one unit's bug must not stop the others' scaling
                    log.exception("autoscaler tick for %s failed", backend.name)

    async def _serve_adapter(self, unit: str, name: str, path: str) -> None:
        backend = self.units.get(unit)
        if backend is not None and not isinstance(backend, UnitBackend):
            raise InvalidRequestError(f"unit {unit!r} is a {backend.spec.kind} unit: it cannot serve the adapter "
                                      f"{name!r}", param="serve_into", code="lora_unsupported")
        if backend is None:
            raise InvalidRequestError(f"no unit {unit!r} to serve the adapter {name!r} (deployed: "
                                      f"{', '.join(sorted(self.units)) or 'none'})", param="serve_into",
                                      code="unit_not_found")
        await backend.load_adapter(name, path)

    async def shutdown(self) -> None:
        await self.finetune.close()
        if self._loop_task is not None:
            self._loop_task.cancel()
        for name in list(self.units):
            backend = self.units.pop(name)
            await backend.close()
        if self.zygote is not None:
            await self.zygote.shutdown()
        if self.cluster is not None:
            await self.cluster.close()
        self.store.close()
        self.memory.close()
        if self.tenancy is not None:
            await self.tenancy.aclose()

    def status(self) -> dict:
        out = {"units": [b.view() for b in self.units.values()], "events": list(self.events)[-50:]}
        if self._standbys and self.zygote is not None:     # processes standing by per device: ready / asked
            out["standby"] = {d: {"ready": self.zygote.ready_standbys(d), "target": n}
                              for d, n in sorted(self._standbys.items()) if n}
        if self.ledger is not None:
            out["memory"] = self.ledger.view()
        if self.device_ledgers:
            out["device_memory"] = {d: ledger.view() for d, ledger in sorted(self.device_ledgers.items())}
        if self.cluster is not None:
            out["nodes"] = self.cluster.view()
        return out
