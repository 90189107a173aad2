"""What the HTTP layer serves from: named backends that turn a prompt into token events.

``sits serve`` has one backend, an in-process ``AsyncEngine``. The runtime's gateway provides the
same interface per unit (instances behind it), so both dialects work unchanged through it.
"""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import AsyncIterator, Mapping
from typing import Protocol

import numpy as np

from sits.api.errors import ModelNotFoundError, ServiceUnavailableError, clip
from sits.engine.async_engine import AsyncEngine
from sits.engine.errors import InvalidRequestError, SitsError
from sits.engine.messages import EngineRequest, EngineStats, TokenEvent
from sits.engine.sampling_params import SamplingParams
from sits.engine.tokenizer import Tokenizer
from sits.runtime.features import BackendFeatures
from sits.runtime.hints import RequestHints
from sits.tenancy.cost import ModelShape
from sits.tenancy.principal import current_principal


class Backend(Protocol):
    name: str
    root: str                 # where the model came from (a directory)
    created: int              # unix seconds
    max_model_len: int
    kv_capacity_tokens: int   # prompt + output of one request can never exceed this
    tokenizer: Tokenizer
    features: BackendFeatures  # SLO, tools, memory: declared, never probed
    sampling_defaults: Mapping[str, float]   # the model's generation_config.json defaults (config.generation_defaults)

    @property
    def ready(self) -> bool: ...

    def prepare(self, prompt: str | list[int], params: SamplingParams, *, request_id: str,
                priority: int = 0, interactive: bool = True, add_special_tokens: bool = True) -> EngineRequest:
        """Validate and tokenize (raises the typed SitsError); nothing is queued yet. A text prompt
        gets the tokenizer's special tokens (its BOS) unless ``add_special_tokens`` is false."""

    def stream(self, prepared: EngineRequest, hints: RequestHints | None = None) -> AsyncIterator[TokenEvent]:
        """Queue a prepared request; its token events until the finished one. Closing it aborts.
        ``hints`` (session, trace, route) steer routing and faults where there is a choice to make."""

    def abort(self, request_id: str, error: SitsError | None = None) -> None:
        """Stop a queued or running request; its stream raises ``error``."""

    def stats(self) -> EngineStats: ...

    def session_instance(self, session_id: str) -> str | None:
        """Which instance served the session last (kept in the session for affinity); None for one engine."""

    def admit(self) -> "Backend":
        """Who serves a request addressed to this backend: itself, or (a unit whose SLA breaker is
        open) its fallback; raises a typed 503 when neither can take it."""

    async def embed(self, inputs: list[list[int]]) -> np.ndarray:
        """Unit vectors of the model's mean-pooled hidden states, one row per token-id list."""


class ModelNotAllowedError(SitsError):
    code = "model_not_allowed"
    http_status = 403


class EngineBackend:
    """An in-process AsyncEngine under a served name."""

    def __init__(self, engine: AsyncEngine, name: str | None = None):
        self.engine = engine
        self.root = str(engine.engine.cfg.model)
        self.name = name or os.path.basename(os.path.normpath(self.root))
        self.created = int(time.time())
        self.max_model_len = engine.engine.max_model_len
        pool = engine.engine.pool
        self.kv_capacity_tokens = pool.num_blocks * pool.block_size
        self.tokenizer = engine.tokenizer
        eng = engine.engine
        self.features = BackendFeatures(shape=ModelShape.of(eng.model_config, eng.dtype.itemsize),
                                        kv_block_size=eng.cfg.block_size)
        self.sampling_defaults = engine.engine.sampling_defaults

    @property
    def ready(self) -> bool:
        return self.engine.alive

    def prepare(self, prompt, params, *, request_id, priority=0, interactive=True,
                add_special_tokens=True, lora: str | None = None) -> EngineRequest:
        return self.engine.prepare(prompt, params, request_id=request_id, priority=priority,
                                   interactive=interactive, add_special_tokens=add_special_tokens, lora=lora)

    @property
    def adapters(self) -> list[dict]:
        return self.engine.adapters

    async def load_adapter(self, name: str, path: str) -> list[dict]:
        return await self.engine.load_adapter(name, path)

    async def unload_adapter(self, name: str) -> list[dict]:
        return await self.engine.unload_adapter(name)

    def stream(self, prepared: EngineRequest, hints: RequestHints | None = None) -> AsyncIterator[TokenEvent]:
        return self.engine.stream(prepared)

    def abort(self, request_id: str, error: SitsError | None = None) -> None:
        self.engine.abort(request_id, error)

    def stats(self) -> EngineStats:
        return self.engine.stats()

    def admit(self) -> "EngineBackend":
        return self

    def session_instance(self, session_id: str) -> None:
        return None

    async def embed(self, inputs: list[list[int]]) -> np.ndarray:
        return await asyncio.to_thread(self.engine.engine.embed, inputs)


class AdapterBackend:
    """A LoRA adapter as a model of its own, ``<parent>:<adapter>``: everything is its parent's (the
    engine or unit that serves it), except that its requests run with the adapter."""

    def __init__(self, parent: Backend, adapter: str):
        self.parent = parent
        self.adapter = adapter
        self.name = f"{parent.name}:{adapter}"

    def __getattr__(self, attr: str):
        return getattr(self.parent, attr)

    def prepare(self, prompt, params, *, lora: str | None = None, **kw) -> EngineRequest:
        return self.parent.prepare(prompt, params, lora=self.adapter, **kw)

    async def embed(self, inputs: list[list[int]]) -> np.ndarray:
        raise InvalidRequestError(f"{self.name} is a LoRA adapter: embeddings come from its base model "
                                  f"{self.parent.name}", param="model", code="adapter_embeddings_unsupported")

    def admit(self) -> "AdapterBackend":
        admitted = self.parent.admit()
        return self if admitted is self.parent else AdapterBackend(admitted, self.adapter)


def adapter_names(backend: Backend) -> list[str]:
    """The LoRA adapters ``backend`` serves (none for a backend without adapter support)."""
    return [a["name"] for a in getattr(backend, "adapters", None) or []]


class BackendRegistry:
    """Served names -> backends; an unknown name is a 404 ``model_not_found``."""

    def __init__(self, backends: list[Backend] | None = None, loading: list[str] | None = None,
                 mapping: dict | None = None):
        """``mapping``: serve from a dict someone else keeps current (the runtime's deployed units);
        such a registry is ready with no entries too (a gateway with nothing deployed yet)."""
        self._by_name: dict[str, Backend] = mapping if mapping is not None else {}
        self._shared = mapping is not None
        self.loading: set[str] = set(loading or [])    # names still starting (503 model_loading)
        for b in backends or []:
            self.add(b)

    def add(self, backend: Backend) -> None:
        self._by_name[backend.name] = backend
        self.loading.discard(backend.name)

    def get(self, name: str | None) -> Backend:
        if name in self.loading or (name is None and not self._by_name and self.loading):
            err = ServiceUnavailableError(f"the model {name or next(iter(self.loading))!r} is still loading; "
                                          "retry when GET /ready says ready", param="model", code="model_loading")
            err.retry_after_s = 1
            raise err
        if name is None:
            name = self.default_name()
        backend = self._by_name.get(name) or self._adapter(name)
        if backend is None:
            raise ModelNotFoundError(f"the model {clip(name)} does not exist; served: "
                                     f"{', '.join(sorted(self.visible())) or 'none'}", param="model")
        principal = current_principal.get()
        if not (principal.may_call(name) or isinstance(backend, AdapterBackend)
                and (principal.may_call(backend.name) or principal.may_call(backend.parent.name))):
            raise ModelNotAllowedError(f"this API key may not call {clip(name)}; it may call: "
                                       f"{', '.join(sorted(self.visible())) or 'nothing served now'}", param="model")
        return backend.admit()

    def _adapter(self, name: str) -> AdapterBackend | None:
        """``<parent>:<adapter>``, or an adapter's own name where one backend serves it."""
        parent_name, sep, adapter = name.rpartition(":")      # adapter names hold no ':' (unit names may)
        if sep:
            parent = self._by_name.get(parent_name)
            return AdapterBackend(parent, adapter) if parent is not None and adapter in adapter_names(parent) else None
        serving = [b for b in self._by_name.values() if name in adapter_names(b)]
        if len(serving) > 1:
            raise InvalidRequestError(f"several models serve an adapter {clip(name)}: name one as "
                                      f"{' or '.join(f'{b.name}:{name}' for b in serving)}", param="model",
                                      code="ambiguous_model")
        return AdapterBackend(serving[0], name) if serving else None

    def visible(self) -> list[str]:
        """The names the current caller's key may call."""
        principal = current_principal.get()
        return [n for n in self._by_name if principal.may_call(n)]

    def default_name(self) -> str:
        """The name a request that names none gets: the only one served; 400 ``model_required`` otherwise."""
        names = self.visible()
        if len(names) != 1:
            raise InvalidRequestError(f"name a model; served: {', '.join(sorted(names)) or 'none'}",
                                      param="model", code="model_required")
        return names[0]

    def all(self) -> list[Backend]:
        return list(self._by_name.values())

    @property
    def ready(self) -> bool:
        return ((bool(self._by_name) or self._shared) and not self.loading
                and all(b.ready for b in self._by_name.values()))
