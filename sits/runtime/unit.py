"""A deployed unit: what it is (spec, instance pool, autoscaler, SLA breaker, faults, status) behind
the HTTP layer's ``Backend`` API.

It validates and tokenizes in the gateway (with the unit's tokenizer, loaded at deploy time, so a
unit at zero instances still answers 4xx for bad input at once, against the limits every instance
will report). Which instance serves a request is its ``UnitDispatcher``'s business.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import os
import time
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING

import numpy as np
import torch

from sits.engine.config import ModelConfig, activation_reserve_bytes, generation_defaults
from sits.engine.errors import InvalidRequestError, ModelLoadError, SitsError
from sits.engine.lora import AdapterExistsError, AdapterNotFoundError, load_adapter
from sits.engine.messages import EngineRequest, EngineStats, TokenEvent
from sits.engine.request_validator import RequestValidator, plan_limits
from sits.engine.sampling_params import SamplingParams
from sits.engine.tokenizer import Tokenizer
from sits.faults import FaultInjector, FaultsSpec
from sits.runtime.autoscaler import Autoscaler, ScaleDecision
from sits.runtime.sla import SlaBreaker
from sits.runtime.unit_guard import FallbackGuard
from sits.runtime.unit_metrics import CpuMeter, MetricsWindow
from sits.runtime.unit_pool import UnitPool
from sits.runtime.unit_spec import UnitSpec
from sits.runtime.features import DEFAULT_MEMORY_TOP_K, BackendFeatures, model_shape
from sits.runtime.hints import RequestHints
from sits.runtime.device_memory import CUDA_CONTEXT_BYTES, device_key
from sits.runtime.host_fit import check_fits_host, instance_weight_bytes
from sits.runtime.dispatcher import UnitDispatcher

if TYPE_CHECKING:
    from sits.runtime.gateway import UnitHost



class LoraDisabledError(SitsError):
    code = "lora_disabled"
    http_status = 400

log = logging.getLogger("sits.runtime")
MEMORY_ACCOUNT_INTERVAL_S = 60.0     # a live instance's memory-time is apportioned this often
COLD_START_GUESS_MS = 5000.0         # a unit that has never started: what its first start is assumed to take



class UnitBackend(FallbackGuard):
    def __init__(self, spec: UnitSpec, host: "UnitHost"):
        self.spec = spec
        self.name = spec.name
        self.root = spec.model
        self.created = int(time.time())
        if not os.path.exists(spec.model):
            raise InvalidRequestError(f"unit {spec.name}: model {spec.model} does not exist (a model directory or "
                                      "a .gguf file)",
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
            memory_top_k=spec.memory.top_k if spec.memory else DEFAULT_MEMORY_TOP_K, pricing=spec.pricing,
            shape=model_shape(spec.model, spec.resources.dtype, spec.resources.device, mc),
            kv_block_size=spec.engine_config().block_size)
        self.sampling_defaults = generation_defaults(spec.model) | spec.sampling.overrides()
        self.host = host
        shape = self.features.shape
        weight_bytes = instance_weight_bytes(spec, mc)
        self.footprint_bytes = weight_bytes + self.limits.kv_capacity_tokens * shape.kv_bytes_per_token
        self._memory_accounted_at = time.monotonic()
        self.pool = UnitPool(spec, on_event=self._pool_event,
                             launcher=lambda: host.launcher(self.spec, self.footprint_bytes),
                             tokenizer=self.tokenizer, limits=self.limits,
                             footprint_bytes=self.footprint_bytes,
                             on_stopped=lambda inst: self._account_memory(inst, final=True),
                             reserve_memory=lambda inst: host.reserve_memory(self, inst),
                             release_memory=lambda inst: host.release_memory(inst))
        self.weight_bytes = weight_bytes
        self.kv_bytes = self.footprint_bytes - weight_bytes
        # on a GPU an instance also holds a step's activations, kernels' workspaces and its CUDA context
        self.device: str = device_key(spec.resources.device)
        self.device_reserve_bytes = 0
        if self.device.startswith("cuda"):
            dtype = torch.float32 if spec.resources.dtype == "float32" else torch.bfloat16
            self.device_reserve_bytes = activation_reserve_bytes(mc, spec.engine_config(), dtype) + CUDA_CONTEXT_BYTES
        self.autoscaler = Autoscaler(spec.scale, spec.slo)
        self.window = MetricsWindow(spec.scale.window_s)
        self.cpu = CpuMeter()
        self.last_decision: ScaleDecision | None = None
        self.breaker = SlaBreaker(spec.sla, spec.slo.ttft_ms, on_transition=self._breaker_moved)
        self.fallbacks = 0                        # requests sent to the fallback unit while open
        self.faults = FaultInjector(spec.faults or FaultsSpec())
        self._directed: dict[str, object] = {}    # instance id -> the fault directives it was sent
        self._past_fault_hits: collections.Counter = collections.Counter()
        self.dispatcher = UnitDispatcher(self)

    @property
    def fault_hits(self) -> collections.Counter:
        """Times each fault kind acted on this unit, over every fault set it had (for metrics)."""
        return self._past_fault_hits + self.faults.hits

    # -- faults ---------------------------------------------------------------------------------------
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
                interactive: bool = True, add_special_tokens: bool = True, lora: str | None = None) -> EngineRequest:
        if lora is not None and lora not in self.spec.adapters:
            raise AdapterNotFoundError(f"unit {self.name} serves no LoRA adapter {lora!r}", param="model")
        if isinstance(prompt, str) and self.spec.prompt_template is not None:
            prompt = self.spec.render_prompt(prompt)
        ids = self.validator.prompt_ids(prompt, params, priority, add_special_tokens=add_special_tokens)
        if self.dispatcher.in_use(request_id):
            raise InvalidRequestError(f"request id {request_id!r} is already in use", param="request_id",
                                      code="duplicate_request_id")
        return EngineRequest(request_id, ids, params, priority, interactive, lora=lora)

    # -- LoRA adapters --------------------------------------------------------------------------------
    @property
    def adapters(self) -> list[dict]:
        return [{"name": n, "path": p} for n, p in self.spec.adapters.items()]

    def _set_adapters(self, adapters: dict[str, str]) -> None:
        """The unit's adapters from now on: what every instance that starts later loads."""
        self.spec = self.pool.spec = self.spec.model_copy(update={"adapters": adapters})

    async def load_adapter(self, name: str, path: str) -> list[dict]:
        """Serve a LoRA adapter on every running instance now and every instance started later."""
        if name in self.spec.adapters:
            raise AdapterExistsError(f"unit {self.name} serves an adapter {name!r} already; unload it first",
                                     param="lora_name")
        ready = self.pool.ready()
        if not ready:       # nobody to read it now: checked here, so a bad folder is refused at once
            mc = ModelConfig.from_dir(self.spec.model)
            await asyncio.to_thread(load_adapter, name, path, mc, torch.float32, self.spec.resources.max_lora_rank)
        done = []
        try:
            for inst in ready:
                await inst.backend.load_adapter(name, path)
                done.append(inst)
        except SitsError as e:
            for inst in done:
                await inst.backend.unload_adapter(name)
            if e.code == "lora_disabled":
                raise LoraDisabledError(f"unit {self.name} runs without LoRA support: deploy it with "
                                        f"resources.lora: true (or declare adapters:)", param="lora_name") from None
            raise
        self._set_adapters({**self.spec.adapters, name: path})
        self.host.record(self.name, "adapter_loaded", {"adapter": name, "path": path, "instances": len(done)})
        return self.adapters

    async def unload_adapter(self, name: str) -> list[dict]:
        if name not in self.spec.adapters:
            raise AdapterNotFoundError(f"unit {self.name} serves no LoRA adapter {name!r}", param="lora_name")
        path = self.spec.adapters[name]
        done = []
        try:
            for inst in self.pool.ready():
                await inst.backend.unload_adapter(name)
                done.append(inst)
        except SitsError:
            for inst in done:       # one instance still runs requests of it: all keep it
                await inst.backend.load_adapter(name, path)
            raise
        self._set_adapters({n: p for n, p in self.spec.adapters.items() if n != name})
        self.host.record(self.name, "adapter_unloaded", {"adapter": name})
        return self.adapters

    def _pool_event(self, kind: str, data: dict) -> None:
        self.host.record(self.name, kind, data)
        if kind == "instance_ready":        # started with the adapters of its start: any loaded since are added
            inst = next((i for i in self.pool.ready() if i.id == data.get("instance")), None)
            if inst is not None:
                missing = {n: p for n, p in self.spec.adapters.items()
                           if n not in {a["name"] for a in inst.backend.adapters}}
                if missing:
                    asyncio.get_running_loop().create_task(self._add_adapters(inst, missing))

    async def _add_adapters(self, inst, adapters: dict[str, str]) -> None:
        for name, path in adapters.items():
            try:
                await inst.backend.load_adapter(name, path)
            except SitsError as e:
                log.error("unit %s: instance %s could not load adapter %s: %s", self.name, inst.id, name, e)

    async def close(self, error: SitsError | None = None) -> None:
        """Stop its instances; requests still waiting for one end with ``error``."""
        if error is not None:
            self.dispatcher.abort_waiting(error)
        await self.pool.shutdown()

    def stream(self, seq: EngineRequest, hints: RequestHints | None = None) -> AsyncIterator[TokenEvent]:
        """Which instance serves it, with failover as a resume: the dispatcher's (``dispatcher.py``)."""
        return self.dispatcher.stream(seq, hints)

    def abort(self, request_id: str, error: SitsError | None = None) -> None:
        self.dispatcher.abort(request_id, error)

    async def embed(self, inputs: list[list[int]]) -> np.ndarray:
        return await self.dispatcher.embed(inputs)

    def session_instance(self, session_id: str) -> str | None:
        """Where the session's last request ran (recorded in the session for affinity)."""
        return self.dispatcher.router.instance_of(session_id)

    def stats(self) -> EngineStats:
        return self._aggregate([i.backend.stats() for i in self.pool.ready()])

    def _aggregate(self, ready: list[EngineStats]) -> EngineStats:
        if not ready:
            return EngineStats(self.dispatcher.waiting, 0, 0.0, 0, 0, 0, 0, 0.0, 0, 0, self.spec.resources.policy,
                               self.pool.last_cold_start())
        blocks = sum(s.num_kv_blocks for s in ready)
        free = sum(s.num_free_blocks for s in ready)
        queries = sum(s.prefix_queries for s in ready)
        hits = sum(s.prefix_hits for s in ready)
        waiting = sum(s.num_waiting for s in ready) + self.dispatcher.waiting
        return EngineStats(waiting, sum(s.num_running for s in ready),
                           1.0 - free / blocks if blocks else 0.0, blocks, free, queries, hits,
                           hits / queries if queries else 0.0, sum(s.num_preemptions for s in ready),
                           sum(s.num_steps for s in ready), self.spec.resources.policy,
                           self.pool.last_cold_start())

    def predicted_ttft_ms(self) -> float:
        """The TTFT a request sent now would likely see: the recent p95, the queue ahead of it spread
        over the READY instances, and a cold start when none is READY (what a mesh routes by)."""
        p95 = self.window.snapshot().ttft_p95 or 0.0
        ready = len(self.pool.ready())
        queue = self.dispatcher.waiting
        if ready:
            return p95 * (1 + queue / ready)
        cold = self.pool.last_cold_start().get("total_ms") or COLD_START_GUESS_MS
        return cold + p95 * (1 + queue)

    # -- scaling --------------------------------------------------------------------------------------
    def tick(self, now: float) -> ScaleDecision:
        ready = self.pool.ready()
        per = [i.backend.stats() for i in ready]
        st = self._aggregate(per)
        cpu = self.cpu.read([i.pid for i in ready if i.pid])
        gpus = [s.gpu_util for s in per if s.gpu_util is not None]
        m = self.window.snapshot(queue_depth=st.num_waiting, inflight=self.dispatcher.inflight, cpu_util=cpu,
                                 gpu_util=sum(gpus) / len(gpus) if gpus else None,
                                 kv_util=st.kv_usage if st.num_kv_blocks else None)
        d = self.autoscaler.decide(m, current=self.pool.desired, starting=len(self.pool.starting()), now=now,
                                   idle_since=self.dispatcher.idle_since)
        self.last_decision = d
        if d.target != self.pool.desired:
            self.host.record(self.name, "scale", {"from": d.current, "to": d.target, "reason": d.reason,
                                                     "slo_health": d.health, "direction": d.direction})
            log.info("unit %s: scale %d -> %d (%s)", self.name, d.current, d.target, d.reason)
            self.pool.scale_to(d.target, d.reason, urgent=d.current == 0 and self.dispatcher.waiting > 0)
        else:
            self.pool.reconcile(d.reason)        # replaces crashed instances
        if self.faults.active or self._directed:
            self.direct_instances()
        if time.monotonic() - self._memory_accounted_at >= MEMORY_ACCOUNT_INTERVAL_S:
            self._memory_accounted_at = time.monotonic()
            for inst in self.pool.ready():
                self._account_memory(inst, final=False)
        return d

    def _account_memory(self, inst, final: bool) -> None:
        """The instance's memory-time since the last time, to the tenants it served (usage rows)."""
        tenancy = self.host.tenancy
        if inst.meter is None or tenancy is None:
            return
        shares = inst.meter.close(time.monotonic(), final)
        if shares:
            tenancy.record_instance(self.name, inst.id, shares, self.spec.pricing.per_gb_hour)

    def _device_memory_mb(self) -> float | None:
        """Device memory the ready instances hold (from their last stats); None without a GPU."""
        held = [s.device_memory_mb for s in (i.backend.stats() for i in self.pool.ready())
                if s.device_memory_mb is not None]
        return round(sum(held), 1) if held else None

    def view(self) -> dict:
        d = self.last_decision
        m = self.window.snapshot(queue_depth=self.dispatcher.waiting, inflight=self.dispatcher.inflight)
        return {
            "name": self.name, "model": self.spec.model, "desired": self.pool.desired,
            "instances": [i.view() for i in self.pool.instances], "waiting": self.dispatcher.waiting,
            "inflight": self.dispatcher.inflight,
            "metrics": {"ttft_p95_ms": m.ttft_p95, "itl_p95_ms": m.itl_p95, "rps": round(m.rps, 3),
                        "tps": round(m.tps, 3)},
            "slo_health": d.health if d else None, "last_decision": None if d is None else
            {"from": d.current, "to": d.target, "reason": d.reason},
            "starts": self.pool.starts, "crashes": self.pool.crashes, "start_failure": self.pool.failure_view(),
            "routed": dict(self.dispatcher.routed),
            "cold_start": self.pool.last_cold_start(),
            "memory_mb": None if getattr(self.host, "ledger", None) is None else
            round(self.host.ledger.by_unit().get(self.name, 0) / 2**20, 1),
            "device_memory_mb": self._device_memory_mb(),
            "host_copy": self.host.host_copy(self) if hasattr(self.host, "host_copy") else None,
            "memory": None if self.spec.memory is None else {**self.spec.memory.model_dump(), "ingested": self.ingested},
            "sla": self.breaker.view() | {"fallback": self.spec.fallback, "fallbacks": self.fallbacks},
            "faults": self.faults.view() if self.faults.spec.inject else None,
            "spec": self.spec.model_dump(),
        }
