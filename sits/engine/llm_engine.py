"""LLMEngine: the synchronous step loop (schedule -> run -> sample -> detokenize -> stop checks).

It is driven by one thread: the AsyncEngine's, or a caller's loop (tests, benchmarks). Nothing here
blocks or sleeps; ``step()`` does one batch and returns the token events it produced.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import time
from dataclasses import dataclass
from itertools import count

import numpy as np
import torch

from sits.engine.block_pool import BlockPool
from sits.engine.cold_start import ColdStartReport, process_age_s
from sits.engine.config import (EngineConfig, ModelConfig, activation_reserve_bytes, generation_defaults,
                               default_step_budget, kv_blocks_for_device, resolve_attention, resolve_device,
                               resolve_cpu_kernel, resolve_dtype, resolve_gguf_blocks)
from sits.engine.host_memory import keep_step_buffers_in_heap, release_free_heap
from sits.engine.host_weights import SharedHostRegion, dumps_in_region, loads_in_region, move_to_shared_region
from sits.engine.layers.linear import can_pack, can_split, pack_linears, split_linears
from sits.engine.quantization import quantize_model
from sits.engine.detokenizer import IncrementalDetokenizer
from sits.engine.device_init import init_device
from sits.engine.errors import (EngineStepError, InsufficientDeviceMemoryError, InvalidRequestError,
                               NonFiniteLogitsError, SitsError)
from sits.engine.guided import vocabulary_for
from sits.engine.kv_cache import KVCache, bytes_per_block
from sits.engine.loader import load_model, upload_module
from sits.engine.lora import AdapterInUseError, AdapterManager, AdapterNotFoundError, LoraAdapter
from sits.engine.messages import EngineLimits, EngineRequest, EngineStats, TokenEvent
from sits.engine.model_runner import ModelRunner
from sits.engine.request_validator import RequestValidator, plan_limits
from sits.engine.sampler import Sampler
from sits.engine.sampling_params import SamplingParams
from sits.engine.scheduler import ScheduledBatch, Scheduler
from sits.engine.sequence import FinishReason, Sequence
from sits.engine.tokenizer import Tokenizer
from sits.engine.warmup import run_warmup

log = logging.getLogger("sits.engine")

@dataclass(slots=True)
class _Request:
    seq: Sequence
    detok: IncrementalDetokenizer
    stop_ids: frozenset[int]


def prepare_weights(model: torch.nn.Module, cfg: EngineConfig, dtype: torch.dtype,
                    device: torch.device) -> torch.nn.Module:
    """The loaded weights as they will serve: q/k/v and gate/up merged where the weights are copied
    anyway (converted or dequantized at load, packed, quantized or on a GPU; weights mapped from the
    file in their own dtype stay views of it),
    quantized when asked, then laid out for the device's kernels (bf16 linears pre-packed for oneDNN
    on a CPU that computes bf16; fp32 linears on a CPU split their few-row matmuls across threads)."""
    pack = cfg.pack_weights and can_pack(dtype, device)
    if (pack or cfg.quantization is not None or device.type == "cuda"     # the weights are copied anyway
            or getattr(model, "weights_copied", False)):
        model.fuse_projections()
        release_free_heap()          # the parts' memory, left as holes between the merged copies
    if cfg.quantization is not None:
        quantize_model(model, cfg.quantization, dtype)
    if pack:
        pack_linears(model)
    elif can_split(dtype, device):
        split_linears(model)
    return model


@dataclass(slots=True)
class PreloadedModel:
    """A model and tokenizer built ahead of time in host memory (by a zygote, before it forks
    engines). For a CPU engine it is the engine's model; for a GPU engine it is the weights as they
    will serve (the device's dtype, projections merged) kept in host RAM, in one region forks share
    (``host_weights``), so a start copies them to the device instead of reading and converting the
    checkpoint (vLLM's sleep mode, level 1, keeps weights the same way)."""

    model_dir: str
    dtype: str
    layout: tuple[str | None, bool, str]  # (quantization, pack_weights, gguf_weights): how the weights were prepared
    max_model_len: int
    model_config: ModelConfig
    model: torch.nn.Module
    tokenizer: Tokenizer
    device_type: str = "cpu"           # the device the weights were prepared for
    host_region: SharedHostRegion | None = None      # where a GPU model's weights live (shared with forks)

    @classmethod
    def load(cls, cfg: EngineConfig) -> "PreloadedModel":
        """Built on the CPU whatever ``cfg.device`` is: no CUDA context is created (a zygote forks)."""
        mc = ModelConfig.from_dir(cfg.model)
        max_len = plan_limits(cfg, mc).max_model_len
        cpu, target = torch.device("cpu"), torch.device(resolve_device(cfg.device).type)
        if target.type != "cpu" and cfg.quantization is not None:
            raise ValueError("quantized weights are prepared on their device")
        dtype = resolve_dtype(cfg.dtype, target, mc.torch_dtype)
        blocks = resolve_gguf_blocks(cfg.gguf_weights, str(cfg.model), target, dtype, cfg.quantization)
        model = prepare_weights(load_model(cfg.model, mc, cpu, dtype, max_len, gguf_blocks=blocks), cfg, dtype, target)
        region = move_to_shared_region(model) if target.type != "cpu" else None
        return cls(str(cfg.model), cfg.dtype, (cfg.quantization, cfg.pack_weights, cfg.gguf_weights), max_len, mc,
                   model, Tokenizer.from_dir(cfg.model), target.type, region)

    @staticmethod
    def key(cfg: EngineConfig) -> tuple:
        return (os.path.realpath(str(cfg.model)), cfg.dtype, cfg.quantization, cfg.pack_weights, cfg.gguf_weights,
                cfg.max_model_len, resolve_device(cfg.device).type)

    def fits(self, cfg: EngineConfig, device: torch.device) -> bool:
        return (device.type == self.device_type and self.dtype == cfg.dtype
                and self.layout == (cfg.quantization, cfg.pack_weights, cfg.gguf_weights)
                and os.path.realpath(self.model_dir) == os.path.realpath(str(cfg.model))
                and self.max_model_len == plan_limits(cfg, self.model_config).max_model_len)

    def export(self) -> tuple[int, int, bytes]:
        """A GPU model's host copy for another process: its region's descriptor and size, and the rest
        pickled with its tensors as places in the region (``attach`` rebuilds it around the same pages)."""
        if self.host_region is None:
            raise ValueError("only weights kept in a shared region can be sent to another process")
        fields = tuple(getattr(self, f.name) for f in dataclasses.fields(self) if f.name != "host_region")
        return self.host_region.fd, self.host_region.nbytes, dumps_in_region(fields, self.host_region)

    @classmethod
    def attach(cls, fd: int, nbytes: int, data: bytes) -> "PreloadedModel":
        """What ``export`` sent, with ``fd`` (then owned here) mapped: no weight is copied."""
        region = SharedHostRegion(nbytes, fd=fd)
        return cls(*loads_in_region(data, region), host_region=region)

    def model_on(self, device: torch.device, dtype: torch.dtype) -> torch.nn.Module:
        """The model for an engine on ``device``: this one on a CPU; on a GPU, its weights copied there."""
        return self.model if device.type == "cpu" else upload_module(self.model, device, dtype)


class LLMEngine:
    def __init__(self, cfg: EngineConfig, preloaded: PreloadedModel | None = None,
                 start_requested_at: float | None = None):
        """``preloaded``: weights and tokenizer already built in this process (inherited from a zygote);
        ``start_requested_at``: ``time.monotonic()`` when this start was asked of a process that existed
        before (a standby), so ``imports`` is not the process's whole age."""
        self.report = ColdStartReport()
        age = process_age_s() if start_requested_at is None else time.monotonic() - start_requested_at
        if age is not None:
            self.report.record("imports", age * 1e3)
        self.device = resolve_device(cfg.device)
        if cfg.max_num_batched_tokens is None:      # resolved here, where the device is known
            cfg = dataclasses.replace(cfg, max_num_batched_tokens=default_step_budget(self.device))
        self.cfg = cfg
        if self.device.type == "cuda":
            with self.report.phase("cuda_init"):    # the context, created now rather than by the first copy
                init_device(self.device)            # (free in a standby process: it made it while waiting)
        self.threads = cfg.threads or os.cpu_count() or 1
        if self.device.type == "cpu":
            torch.set_num_threads(self.threads)
            keep_step_buffers_in_heap()
        if preloaded is not None and not preloaded.fits(cfg, self.device):
            preloaded = None
        with self.report.phase("config"):
            self.model_config = preloaded.model_config if preloaded else ModelConfig.from_dir(cfg.model)
            self.dtype = resolve_dtype(cfg.dtype, self.device, self.model_config.torch_dtype)
            self.limits = plan_limits(cfg, self.model_config)
            self.max_model_len = self.limits.max_model_len
            self.gguf_blocks = resolve_gguf_blocks(cfg.gguf_weights, str(cfg.model), self.device, self.dtype,
                                                   cfg.quantization)
        self.inherited_weights = preloaded is not None
        # from the checkpoint ("weights"), or the inherited host copy ("weights_h2d" on a GPU: a copy only)
        with self.report.phase("weights_h2d" if preloaded and self.device.type != "cpu" else "weights"):
            self.model = preloaded.model_on(self.device, self.dtype) if preloaded else prepare_weights(
                load_model(cfg.model, self.model_config, self.device, self.dtype, self.max_model_len,
                           gguf_blocks=self.gguf_blocks),
                cfg, self.dtype, self.device)
        with self.report.phase("tokenizer"):
            self.tokenizer = preloaded.tokenizer if preloaded else Tokenizer.from_dir(cfg.model)
            self.sampling_defaults = generation_defaults(cfg.model)
        if self.device.type == "cuda" and cfg.gpu_memory_utilization and not cfg.num_kv_blocks:
            self.limits = self._device_sized_limits()
        with self.report.phase("kv_allocation"):
            num_blocks = self.limits.num_kv_blocks
            self.kv_cache = KVCache(self.model_config, num_blocks, cfg.block_size, self.device, self.dtype,
                                    touch=cfg.kv_touch)
            self.pool = BlockPool(num_blocks, cfg.block_size, cfg.enable_prefix_caching)
        self.validator = RequestValidator(self.tokenizer, self.limits)
        self.adapters: AdapterManager | None = None
        if cfg.lora_enabled:
            with self.report.phase("adapters"):
                self.adapters = AdapterManager(self.model, self.model_config, self.device, self.dtype, cfg.max_loras,
                                               cfg.max_lora_rank)
                for name, path in cfg.lora_adapters:
                    self.adapters.load(name, path)
        self.attention = resolve_attention(cfg.attention, self.device)
        self.linear = resolve_cpu_kernel("linear", cfg.linear, self.device, self.dtype)
        self.elementwise = resolve_cpu_kernel("elementwise", cfg.elementwise, self.device, self.dtype)
        self.model.use_cpu_kernels(linear=self.linear == "cpp", elementwise=self.elementwise == "cpp",
                                   int8_activations=cfg.block_activations == "int8")
        if cfg.block_activations == "int8" and not self.gguf_blocks:
            log.warning("block_activations int8 has no effect: %s serves no GGUF blocks (fp32 CPU engines only)",
                        cfg.model)
        if self.adapters is not None:       # the adapters' few-row products follow the linears' choice
            self.adapters.cpu_kernel = self.linear == "cpp"
        self.runner = ModelRunner(self.model, self.kv_cache, self.device, self.adapters, self.attention,
                                  cfg.max_num_seqs, self.max_model_len, cfg.decode_graphs)
        self.scheduler = Scheduler(cfg, self.pool, self.max_model_len)
        self.sampler = Sampler(default_seed=cfg.seed)
        eos = set(self.model_config.eos_token_id) | set(self.tokenizer.eos_token_ids)
        self.eos_token_ids = frozenset(eos)
        self.requests: dict[str, _Request] = {}
        self._failures: list[tuple[str, SitsError]] = []
        self._ids = count()
        self.num_steps = 0
        if cfg.warmup:
            run_warmup(self.runner, self.pool, self.report, max_batched_tokens=cfg.max_num_batched_tokens,
                       max_num_seqs=cfg.max_num_seqs, max_model_len=self.max_model_len, threads=self.threads,
                       minimal=cfg.warmup_shapes == "minimal")
        self.report.ready_at = time.monotonic()

    def _device_sized_limits(self) -> EngineLimits:
        """The limits with a KV pool of what the device has free within ``gpu_memory_utilization``
        (read after the weights are on it); an engine that cannot hold one longest sequence fails to start."""
        torch.cuda.empty_cache()                 # what load-time copies left cached is free for the pool
        free, total = torch.cuda.mem_get_info(self.device)
        per_block = bytes_per_block(self.model_config, self.cfg.block_size, self.dtype)
        blocks = kv_blocks_for_device(free, total, self.cfg.gpu_memory_utilization,
                                      activation_reserve_bytes(self.model_config, self.cfg, self.dtype), per_block)
        needed = -(-self.max_model_len // self.cfg.block_size)
        # beyond every sequence at full length four times over, more blocks would only be cache
        blocks = min(blocks, 4 * self.cfg.max_num_seqs * needed)
        if blocks < needed:
            raise InsufficientDeviceMemoryError(
                f"{self.device}: {free / 2**30:.1f} of {total / 2**30:.1f} GiB free after the weights leaves room "
                f"for {blocks} KV blocks within gpu_memory_utilization={self.cfg.gpu_memory_utilization}; one "
                f"{self.max_model_len}-token sequence needs {needed} (lower max_model_len or raise the share)")
        return dataclasses.replace(self.limits, num_kv_blocks=blocks)

    # -- requests -------------------------------------------------------------------------------
    def make_request(self, prompt: str | list[int], params: SamplingParams | None = None, *,
                     request_id: str | None = None, priority: int = 0, interactive: bool = True,
                     add_special_tokens: bool = True, lora: str | None = None) -> EngineRequest:
        """Validate and tokenize a request (no engine state touched: safe from any thread)."""
        params = params or SamplingParams()
        if lora is not None:
            self._adapter(lora)
        ids = self.validator.prompt_ids(prompt, params, priority, add_special_tokens=add_special_tokens)
        return EngineRequest(request_id or f"req-{next(self._ids)}", ids, params, priority, interactive, lora=lora)

    def _adapter(self, name: str) -> int:
        """The prefix-cache root of a loaded adapter (raises ``adapter_not_found``)."""
        if self.adapters is None or not self.adapters.has(name):
            loaded = ", ".join(sorted(self.adapters.host)) if self.adapters is not None else ""
            raise AdapterNotFoundError(f"no LoRA adapter {name!r} is loaded" + (f" (loaded: {loaded})" if loaded else
                                       "" if self.adapters is not None else "; this engine serves no adapters"),
                                       param="model")
        return self.adapters.roots[name]

    # -- adapters -------------------------------------------------------------------------------
    def load_adapter(self, name: str, path: str) -> dict:
        """Read a PEFT LoRA folder and serve it as ``name`` (between steps; no request is disturbed)."""
        return self.install_adapter(name, self.read_adapter(name, path))

    def read_adapter(self, name: str, path: str) -> LoraAdapter:
        """A PEFT LoRA folder read into host memory (safe beside the engine's steps: nothing is served yet)."""
        return self._lora_manager().read(name, path)

    def install_adapter(self, name: str, adapter: LoraAdapter) -> dict:
        """Serve an adapter ``read_adapter`` returned (between steps)."""
        self._lora_manager().add(name, adapter)
        return next(a for a in self.adapters.view() if a["name"] == name)

    def _lora_manager(self) -> AdapterManager:
        if self.adapters is None:
            raise InvalidRequestError("this engine was started without LoRA support (enable_lora)", param="lora_name",
                                      code="lora_disabled")
        return self.adapters

    def adapter_views(self) -> list[dict]:
        return self.adapters.view() if self.adapters is not None else []

    def unload_adapter(self, name: str) -> None:
        """Stop serving ``name``; refused while a request of it is unfinished."""
        self._adapter(name)
        busy = sum(1 for r in self.requests.values() if r.seq.lora == name)
        if busy:
            raise AdapterInUseError(f"adapter {name!r} has {busy} unfinished requests; unload it when they end",
                                    param="lora_name")
        self.adapters.unload(name)

    def add(self, req: EngineRequest) -> Sequence:
        """Queue a request; the engine's own ``Sequence`` for it is returned. ``req`` was validated by
        its front end against this engine's ``limits`` (``make_request``, or a front end holding the
        same limits: see ``request_validator``); it is not checked again here."""
        ids = req.prompt_token_ids
        seq = Sequence(req.request_id, ids, req.params, priority=req.priority, interactive=req.interactive,
                       arrival_time=req.arrival_time, tenant=req.tenant, tenant_weight=req.tenant_weight)
        if req.lora is not None:        # unloaded since its front end checked: refused, not run on the base
            seq.lora, seq.cache_root = req.lora, self._adapter(req.lora)
        if req.params.seed is not None:
            seq.generator = torch.Generator().manual_seed(req.params.seed)
        self.enqueue(seq)
        return seq

    def enqueue(self, seq: Sequence) -> None:
        if seq.request_id in self.requests:
            raise InvalidRequestError(f"request id {seq.request_id!r} is already in use", param="request_id",
                                      code="duplicate_request_id")
        p = seq.params
        stop_ids = frozenset(p.stop_token_ids) | (frozenset() if p.ignore_eos else self.eos_token_ids)
        if p.grammar is not None and seq.guide is None:
            seq.guide = vocabulary_for(self.tokenizer, self.model_config.vocab_size).guide(p.grammar, p.grammar_prefix)
        detok = IncrementalDetokenizer(self.tokenizer, seq.prompt_token_ids, stop=p.stop)
        self.requests[seq.request_id] = _Request(seq, detok, stop_ids)
        self.scheduler.add(seq)

    def add_request(self, prompt: str | list[int], params: SamplingParams | None = None, **kw) -> Sequence:
        return self.add(self.make_request(prompt, params, **kw))

    def abort(self, request_id: str) -> bool:
        """Drop a request and free its KV blocks at once; False if it is unknown or done."""
        req = self.requests.pop(request_id, None)
        if req is None:
            return False
        self.scheduler.remove(req.seq)
        req.seq.finish_reason = FinishReason.ABORT
        return True

    def fail(self, request_id: str, error: SitsError) -> bool:
        """End a request with ``error`` (freeing its blocks); its driver hands the error on from
        ``take_failures``. False if it is unknown or done."""
        if not self.abort(request_id):
            return False
        self._failures.append((request_id, error))
        return True

    def take_failures(self) -> list[tuple[str, SitsError]]:
        """Requests the engine ended with an error since the last call: ``(request id, error)``.
        A driver calls it after each ``step()`` and tells each request's consumer."""
        out, self._failures = self._failures, []
        return out

    @property
    def has_unfinished(self) -> bool:
        return bool(self.requests)

    def idle_work(self) -> bool:
        """Background start-up work for idle moments (faulting in an untouched KV pool, then capturing
        the decode graphs a minimal warm-up left for later, one at a time); True while some is left.
        The step loop calls it only when no request is running."""
        graphs = self.runner.graphs
        if self.kv_cache.fully_touched and (graphs is None or not graphs.pending):
            return False
        t0 = time.perf_counter()
        if not self.kv_cache.fully_touched:
            self.kv_cache.touch_some()
            phase = "kv_touch_background"
        else:
            phase = "graphs_background"
            try:
                graphs.capture(max_graphs=1)
            except Exception as e:  # noqa: BLE001 - a serving engine keeps serving, eagerly, without the rest
                graphs.failed = f"{type(e).__name__}: {e}"
                log.warning("capturing decode graphs failed; decode steps of the remaining batch sizes run "
                            "eagerly: %s", graphs.failed)
        self.report.phases_ms[phase] = self.report.phases_ms.get(phase, 0.0) + (time.perf_counter() - t0) * 1e3
        return not self.kv_cache.fully_touched or (graphs is not None and graphs.pending)

    # -- the step -------------------------------------------------------------------------------
    def step(self) -> list[TokenEvent]:
        """One batch: its token events. Requests that failed in it are in ``take_failures()``.

        An unexpected error while computing or sampling the batch (a bug, a device error) ends the
        batch's unfinished requests with ``internal_error`` and the engine goes on serving: one
        request's bad luck is never every request's.
        """
        batch = self.scheduler.schedule()
        if not batch.seqs:
            return []
        t0 = time.perf_counter()
        events: list[TokenEvent] = []
        try:
            logits, rows = self.runner.execute(batch)
            self.scheduler.on_computed(batch)
            if rows:
                self._sample_and_emit(batch, logits, rows, events)
        except Exception as e:  # noqa: BLE001 - reported to each request of the batch, the loop lives on
            log.exception("engine step failed; ending its %d request(s)", len(batch.seqs))
            err = EngineStepError(f"the engine failed while running this request: {type(e).__name__}: {e}")
            failed = {seq.request_id for seq in batch.seqs if self.fail(seq.request_id, err)}
            return [ev for ev in events if ev.request_id not in failed]    # requests that finished stay finished
        self.num_steps += 1
        prefill = sum(n for n in batch.num_new if n > 1)
        self.scheduler.model.observe_step(prefill, len(batch) - sum(1 for n in batch.num_new if n > 1),
                                          time.perf_counter() - t0)
        return events

    def _sample_and_emit(self, batch: ScheduledBatch, logits: torch.Tensor, rows: list[int],
                         events: list[TokenEvent]) -> None:
        """Sample the rows that produce a token and append their events to ``events``."""
        seqs = [batch.seqs[i] for i in rows]
        allowed = [s.guide.allowed() if s.guide is not None else None for s in seqs]
        result = self.sampler.sample(logits, [s.params for s in seqs], [s.output_token_ids for s in seqs],
                                     [s.prompt_token_ids for s in seqs], [s.generator for s in seqs],
                                     allowed if any(a is not None for a in allowed) else None)
        now = time.monotonic()
        failed = set(result.failed_rows)
        for j, seq in enumerate(seqs):
            if j in failed:
                self.fail(seq.request_id, NonFiniteLogitsError(
                    f"request {seq.request_id}: the model's logits gave no finite distribution to sample from "
                    f"at output token {len(seq.output_token_ids)}"))
                continue
            req = self.requests[seq.request_id]
            if seq.first_token_time is None:
                seq.first_token_time = now
                self.report.mark_first_token()
            ev = self._emit(seq, req, result.token_ids[j], now,
                            result.logprobs[j] if result.logprobs is not None and seq.params.logprobs is not None else None,
                            result.top_logprobs[j] if result.top_logprobs is not None and seq.params.logprobs else None)
            events.append(ev)
            # jump-forward (not for logprobs requests: a forced token has no distribution to report)
            if seq.guide is not None and not ev.finished and self.cfg.guided_jump_forward and seq.params.logprobs is None:
                room = min(seq.params.max_tokens - len(seq.output_token_ids), self.max_model_len - seq.num_tokens,
                           self.cfg.max_num_batched_tokens // 4)      # a forced run stays a small part of a step
                for tok in seq.guide.forced(room):
                    events.append(ev := self._emit(seq, req, tok, now, None, None))
                    seq.num_forced += 1
                    if ev.finished:
                        break

    def _emit(self, seq: Sequence, req: _Request, tok: int, now: float, logprob: float | None,
              top_logprobs: list[tuple[int, float]] | None) -> TokenEvent:
        """Append one token to ``seq``: its text delta, and the end of the request if it is one."""
        seq.output_token_ids.append(tok)
        seq.last_token_time = now
        reason = None
        if seq.guide is not None:
            seq.guide.accept(tok)
        if tok in req.stop_ids:
            reason = FinishReason.STOP
            text = ""
        else:
            text = req.detok.step(tok)
            if req.detok.stopped or (seq.guide is not None and seq.guide.complete):
                reason = FinishReason.STOP
        if reason is None and (len(seq.output_token_ids) >= seq.params.max_tokens
                               or seq.num_tokens >= self.max_model_len):
            reason = FinishReason.LENGTH
        if reason is not None:
            text += req.detok.finish()
            seq.finish_reason = reason
            self.scheduler.remove(seq)
            self.scheduler.model.observe_finished(len(seq.output_token_ids))
            del self.requests[seq.request_id]
        return TokenEvent(
            seq.request_id, tok, text, len(seq.output_token_ids) - 1, logprob=logprob, top_logprobs=top_logprobs,
            finished=reason is not None, finish_reason=reason.value if reason else None,
            num_prompt_tokens=len(seq.prompt_token_ids), num_output_tokens=len(seq.output_token_ids),
            num_cached_tokens=seq.num_cached_tokens, arrival_time=seq.arrival_time,
            first_scheduled_time=seq.first_scheduled_time, first_token_time=seq.first_token_time, time=now)

    # -- conveniences ---------------------------------------------------------------------------
    def stats(self) -> EngineStats:
        """Cheap enough for every few steps (an instance sends it with its events): the pool's
        counters only, not ``BlockPool.stats()``, which scans the free list."""
        p = self.pool
        q, free = p.prefix_queries, p.num_free
        return EngineStats(len(self.scheduler.waiting), len(self.scheduler.running), 1.0 - free / p.num_blocks,
                           p.num_blocks, free, q, p.prefix_hits, p.prefix_hits / q if q else 0.0,
                           self.scheduler.num_preemptions, self.num_steps, self.cfg.policy, self.report.to_dict(),
                           self._gpu_util(),
                           torch.cuda.memory_reserved(self.device) / 2**20 if self.device.type == "cuda" else None)

    def _gpu_util(self) -> float | None:
        if self.device.type != "cuda":
            return None
        try:
            return torch.cuda.utilization(self.device) / 100.0     # needs NVML (pynvml); None without it
        except Exception:  # noqa: BLE001 - no NVML, or a device it cannot see
            return None

    def embed(self, inputs: list[list[int]], batch_tokens: int = 4096) -> np.ndarray:
        """Unit vectors [n, hidden] for token-id lists: the mean of the model's final hidden states
        over each input (the fallback embedder of vector memory, and ``/v1/embeddings``). Runs the
        dense path, not the KV pool, so it never competes with serving for blocks; inputs are
        batched by length, right-padded (causal attention: padding changes nothing before it)."""
        for ids in inputs:
            if not ids or len(ids) > self.max_model_len:
                raise InvalidRequestError(f"each input must have 1..{self.max_model_len} tokens, got {len(ids)}",
                                          param="input", code="invalid_input")
        out = np.zeros((len(inputs), self.model_config.hidden_size), dtype=np.float32)
        order = sorted(range(len(inputs)), key=lambda i: len(inputs[i]))
        pad = self.tokenizer.pad_token_id or 0
        with torch.inference_mode():
            start = 0
            while start < len(order):
                end = start + 1
                while end < len(order) and (end - start + 1) * len(inputs[order[end]]) <= batch_tokens:
                    end += 1
                rows = order[start:end]
                width = len(inputs[rows[-1]])            # sorted by length: the last is the longest
                ids = torch.full((len(rows), width), pad, dtype=torch.long)
                mask = torch.zeros((len(rows), width, 1), dtype=torch.float32)
                for r, i in enumerate(rows):
                    ids[r, :len(inputs[i])] = torch.tensor(inputs[i])
                    mask[r, :len(inputs[i])] = 1.0
                h = self.model.hidden_dense(ids.to(self.device)).float().cpu()
                mean = (h * mask).sum(1) / mask.sum(1)
                out[rows] = torch.nn.functional.normalize(mean, dim=-1).numpy()
                start = end
        return out

    def generate(self, prompts: list[str | list[int]], params: SamplingParams | list[SamplingParams] | None = None,
                 ) -> list[dict]:
        """Run prompts to completion (blocking); returns text, token ids and finish reason per prompt."""
        plist = params if isinstance(params, list) else [params] * len(prompts)
        seqs = [self.add_request(p, sp) for p, sp in zip(prompts, plist)]
        texts: dict[str, list[str]] = {s.request_id: [] for s in seqs}
        while self.has_unfinished:
            for ev in self.step():
                if ev.request_id in texts:
                    texts[ev.request_id].append(ev.text)
            for rid, err in self.take_failures():
                if rid in texts:
                    raise err
        return [{"request_id": s.request_id, "text": "".join(texts[s.request_id]),
                 "token_ids": list(s.output_token_ids), "finish_reason": s.finish_reason.value,
                 "num_cached_tokens": s.num_cached_tokens} for s in seqs]
