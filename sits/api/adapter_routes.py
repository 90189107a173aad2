"""LoRA adapters loaded and unloaded while a model serves: ``/v1/units/{unit}/adapters/{name}``, and
vLLM's ``/v1/load_lora_adapter`` / ``/v1/unload_lora_adapter`` shapes for clients written against it.
The control API's rules apply (an admin key once tenants exist). A loaded adapter is called as
``model: "<unit>:<adapter>"`` or by its own name, and ``/v1/models`` lists it with its parent."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field

from sits.api.auth import require_operator
from sits.api.backend import Backend, adapter_names
from sits.api.context import context_of
from sits.api.errors import ModelNotFoundError, clip, error_docs
from sits.engine.errors import InvalidRequestError, SitsError

ERRORS = error_docs({
    400: "not an adapter this model can serve (format, targets, shapes, rank), or a model without adapter support",
    403: "an admin key is needed",
    404: "no such model or adapter",
    409: "an adapter of that name is loaded, or it has unfinished requests",
})
router = APIRouter(tags=["adapters"], dependencies=[Depends(require_operator)], responses=ERRORS)


class LoraUnsupportedError(SitsError):
    code = "lora_unsupported"
    http_status = 400


class AdapterPath(BaseModel):
    model_config = ConfigDict(extra="forbid")
    path: str = Field(..., min_length=1, description="a PEFT LoRA folder on the server (adapter_config.json, "
                                                     "adapter_model.safetensors)")


class LoadLoraAdapter(BaseModel):
    """vLLM's body; ``model`` picks the base when the server serves several."""

    lora_name: str = Field(..., min_length=1)
    lora_path: str = Field(..., min_length=1)
    model: str | None = None


class UnloadLoraAdapter(BaseModel):
    lora_name: str = Field(..., min_length=1)
    model: str | None = None


def _parent(request: Request, unit: str | None, adapter: str | None = None) -> Backend:
    """The model that serves (or will serve) adapters: the one named, the one serving ``adapter``, or
    the only one there is."""
    registry = context_of(request).registry
    backends = {b.name: b for b in registry.all()}
    if unit is None and adapter is not None:
        serving = [b for b in backends.values() if adapter in adapter_names(b)]
        if len(serving) == 1:
            return serving[0]
    if unit is None:
        if len(backends) != 1:
            raise InvalidRequestError(f"name the base model (model); served: {', '.join(sorted(backends)) or 'none'}",
                                      param="model", code="model_required")
        unit = next(iter(backends))
    backend = backends.get(unit)
    if backend is None:
        raise ModelNotFoundError(f"the model {clip(unit)} does not exist; served: "
                                 f"{', '.join(sorted(backends)) or 'none'}", param="model")
    if not hasattr(backend, "load_adapter"):
        raise LoraUnsupportedError(f"{unit} does not serve LoRA adapters", param="model")
    return backend


def _view(backend: Backend, name: str, adapters: list[dict]) -> dict[str, Any]:
    a = next(a for a in adapters if a["name"] == name)
    return {"object": "lora_adapter", "id": f"{backend.name}:{name}", "parent": backend.name, **a}


@router.get("/v1/units/{unit}/adapters")
async def list_adapters(unit: str, request: Request) -> dict[str, Any]:
    backend = _parent(request, unit)
    return {"object": "list", "data": [_view(backend, a["name"], backend.adapters) for a in backend.adapters]}


@router.post("/v1/units/{unit}/adapters/{name}", status_code=201)
async def load_adapter(unit: str, name: str, body: AdapterPath, request: Request) -> JSONResponse:
    backend = _parent(request, unit)
    return JSONResponse(_view(backend, name, await backend.load_adapter(name, body.path)), status_code=201)


@router.delete("/v1/units/{unit}/adapters/{name}")
async def unload_adapter(unit: str, name: str, request: Request) -> dict[str, Any]:
    await _parent(request, unit).unload_adapter(name)
    return {"object": "lora_adapter", "id": f"{unit}:{name}", "deleted": True}


@router.post("/v1/load_lora_adapter")
async def load_lora_adapter(body: LoadLoraAdapter, request: Request) -> JSONResponse:
    backend = _parent(request, body.model)
    return JSONResponse(_view(backend, body.lora_name, await backend.load_adapter(body.lora_name, body.lora_path)))


@router.post("/v1/unload_lora_adapter")
async def unload_lora_adapter(body: UnloadLoraAdapter, request: Request) -> dict[str, Any]:
    backend = _parent(request, body.model, body.lora_name)
    await backend.unload_adapter(body.lora_name)
    return {"object": "lora_adapter", "id": f"{backend.name}:{body.lora_name}", "deleted": True}
