"""``sits serve``'s engine: one instance process, restarted when it dies.

Without it, an instance that dies (the OOM killer, a segfault in a kernel, a bug that escapes the
step loop) leaves a live HTTP server in front of a dead engine: every later request a 503 for good
and the child a zombie. ``SupervisedInstance`` reaps the dead process at once, starts a new one
(with exponential backoff while starts keep failing), and answers ``engine_restarting`` (503 with
``Retry-After``) meanwhile. Streams the dead process was serving end with ``engine_dead``, as
before; under ``sits up`` the gateway resumes them on another instance instead.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections.abc import AsyncIterator

import numpy as np

from sits.engine.errors import SitsError
from sits.engine.messages import EngineRequest, EngineStats, TokenEvent
from sits.engine.sampling_params import SamplingParams
from sits.runtime.features import BackendFeatures, model_shape
from sits.runtime.instance_client import InstanceBackend

log = logging.getLogger("sits.runtime")


class EngineRestartingError(SitsError):
    """The engine process died and a new one is starting; retry shortly."""

    code = "engine_restarting"
    http_status = 503


class SupervisedInstance:
    """The Backend API over the current ``InstanceBackend``; a new one replaces it when it dies."""

    def __init__(self, first: InstanceBackend, *, backoff_s: float = 0.5, backoff_max_s: float = 30.0):
        self.current = first
        self.name = first.name
        self.root = first.root
        self.created = first.created
        self.tokenizer = first.tokenizer
        # what a token costs (usage records): read once here, not at every restart
        self.features = BackendFeatures(shape=model_shape(str(first.cfg.model), first.cfg.dtype, first.cfg.device),
                                        kv_block_size=first.cfg.block_size)
        self.sampling_defaults = first.sampling_defaults
        self.backoff_s = backoff_s
        self.backoff_max_s = backoff_max_s
        self.restarts = 0               # new processes that came up
        self.last_death: str | None = None
        self.last_start_error: str | None = None
        self._delay = backoff_s          # the wait before the next try; doubles while processes keep dying young
        self._up_since = time.monotonic()
        self._restart: asyncio.Task | None = None
        self._restarted = asyncio.Event()
        self._closing = False
        self._adapters: dict[str, str] = dict(first.cfg.lora_adapters)    # served now: a restart starts with them
        self._watch(first)

    @classmethod
    async def spawn(cls, cfg, name: str | None = None, **kw) -> "SupervisedInstance":
        return cls(await InstanceBackend.spawn(cfg, name), **kw)

    # -- what the HTTP layer reads: the current instance's (every instance has the same config) ------
    @property
    def max_model_len(self) -> int:
        return self.current.max_model_len

    @property
    def kv_capacity_tokens(self) -> int:
        return self.current.kv_capacity_tokens

    @property
    def cold_start(self) -> dict:
        return self.current.cold_start

    @property
    def ready(self) -> bool:
        return self.current.ready

    @property
    def pid(self) -> int:
        return self.current.pid

    @property
    def proc(self):
        return self.current.proc

    @property
    def restarting(self) -> bool:
        return self._restart is not None and not self._restart.done()

    # -- the Backend API --------------------------------------------------------------------------------
    def prepare(self, prompt: str | list[int], params: SamplingParams, *, request_id: str, priority: int = 0,
                interactive: bool = True, add_special_tokens: bool = True, lora: str | None = None) -> EngineRequest:
        if self.restarting:
            cause = f" (last start failed: {self.last_start_error})" if self.last_start_error else ""
            err = EngineRestartingError(f"the engine of {self.name} died ({self.last_death}) and is restarting"
                                        f"{cause}; retry shortly")
            err.retry_after_s = 1
            raise err
        return self.current.prepare(prompt, params, request_id=request_id, priority=priority,
                                    interactive=interactive, add_special_tokens=add_special_tokens, lora=lora)

    @property
    def adapters(self) -> list[dict]:
        return self.current.adapters

    async def load_adapter(self, name: str, path: str) -> list[dict]:
        out = await self.current.load_adapter(name, path)
        self._adapters[name] = path          # what a restarted process starts with
        return out

    async def unload_adapter(self, name: str) -> list[dict]:
        out = await self.current.unload_adapter(name)
        self._adapters.pop(name, None)
        return out

    def stream(self, prepared: EngineRequest, hints=None) -> AsyncIterator[TokenEvent]:
        return self.current.stream(prepared)

    def abort(self, request_id: str, error: SitsError | None = None) -> None:
        self.current.abort(request_id, error)

    def stats(self) -> EngineStats:
        return self.current.stats()

    def admit(self) -> "SupervisedInstance":
        return self

    def session_instance(self, session_id: str) -> None:
        return None

    async def embed(self, inputs: list[list[int]]) -> np.ndarray:
        return await self.current.embed(inputs)

    async def shutdown(self) -> None:
        self._closing = True
        if self._restart is not None:
            self._restart.cancel()
            await asyncio.gather(self._restart, return_exceptions=True)
        await self.current.shutdown()

    async def wait_restarted(self, restarts: int) -> None:
        """Until at least ``restarts`` new processes have come up (tests, operators' tooling)."""
        while self.restarts < restarts:
            await self._restarted.wait()

    # -- restarts ---------------------------------------------------------------------------------------
    def _watch(self, inst: InstanceBackend) -> None:
        inst.on_lost = lambda reason: self._died(inst, reason)

    def _died(self, inst: InstanceBackend, reason: str) -> None:
        if self._closing or inst is not self.current or self.restarting:
            return
        self.last_death = reason
        log.error("the engine of %s (pid %s) died: %s; restarting it", self.name, inst.pid, reason)
        self._restart = asyncio.get_running_loop().create_task(self._replace(inst), name=f"restart-{self.name}")

    async def _replace(self, dead: InstanceBackend) -> None:
        await dead.shutdown()            # reaps the process (no zombie) and removes its socket directory
        if time.monotonic() - self._up_since > self.backoff_max_s:
            self._delay = self.backoff_s          # it had lived a while: not a crash loop
        elif self.restarts:
            await self._back_off()                # a restarted process died young: back off
        while not self._closing:
            t0 = time.monotonic()
            try:
                cfg = dataclasses.replace(dead.cfg, lora_adapters=tuple(self._adapters.items()),
                                          enable_lora=dead.cfg.lora_enabled)
                new = await InstanceBackend.spawn(cfg, self.name, tokenizer=self.tokenizer)
            except Exception as e:  # noqa: BLE001 - retried with backoff; requests meanwhile get engine_restarting
                self.last_start_error = f"{type(e).__name__}: {e}"
                log.error("restarting the engine of %s failed (%s); next try in %.1f s",
                          self.name, self.last_start_error, self._delay)
                await self._back_off()
                continue
            self._watch(new)
            self.current = new
            self._up_since = time.monotonic()
            self.restarts += 1
            self.last_start_error = None
            log.info("the engine of %s is back (pid %s) after %.0f ms", self.name, new.pid,
                     (time.monotonic() - t0) * 1e3)
            self._restarted.set()
            self._restarted = asyncio.Event()
            return

    async def _back_off(self) -> None:
        await asyncio.sleep(self._delay)
        self._delay = min(self._delay * 2, self.backoff_max_s)
