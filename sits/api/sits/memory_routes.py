"""``/v1/memory``: memory sets (write, list and search as of a time, forget), snapshots and their
restore, and the causal chain of a memory or a response. Embedding runs off the event loop.

A tenant's sets are stored under its namespace (``tenant/set``): it sees and names only its own,
and the chain shows only its own responses."""

from __future__ import annotations

import json
import math
from typing import Any
from urllib.parse import unquote_to_bytes

from fastapi import APIRouter, Path, Query, Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field, model_validator

from sits.api.context import context_of
from sits.api.errors import error_docs
from sits.engine.errors import InvalidRequestError
from sits.engine.tokenizer import check_text
from sits.memory.vectors import SET_NAME, MemoryNotFoundError, MemoryStore, memory_id, off_loop
from sits.tenancy.principal import scoped, unscoped

router = APIRouter(tags=["memory"])
ERRORS = error_docs({
    400: "invalid request",
    401: "missing or wrong API key",
    404: "no such memory, snapshot or response; or no memory kept",
})
SetName = Path(..., pattern=SET_NAME, description="a memory set: lowercase letters, digits, '.', '_', '-'")


class MemoryWrite(BaseModel):
    model_config = ConfigDict(extra="forbid")
    texts: list[str] = Field(..., min_length=1, max_length=1000)
    metas: list[dict[str, Any]] | None = Field(None, description="one metadata object per text (e.g. source)")

    @model_validator(mode="after")
    def _lengths(self) -> "MemoryWrite":
        if any(not t or len(t) > 100_000 for t in self.texts):
            raise ValueError("each text is 1 to 100000 characters")
        if self.metas is not None and len(self.metas) != len(self.texts):
            raise ValueError("metas, when given, has one object per text")
        if self.metas is not None:
            try:
                json.dumps(self.metas, allow_nan=False)
            except ValueError:
                raise ValueError("metas must be plain JSON (no NaN or Infinity)") from None
        return self


class SnapshotRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    name: str = Field(..., pattern=SET_NAME)


def _finite(as_of: float | None) -> float | None:
    if as_of is not None and not math.isfinite(as_of):
        raise InvalidRequestError("as_of is a unix time in seconds (a finite number)", param="as_of",
                                  code="invalid_parameter")
    return as_of


def _utf8_query(request: Request) -> None:
    """Starlette decodes a query's percent-escapes with U+FFFD for bytes that are not UTF-8: the
    search would run on text the client never sent, so such a query is refused as a body would be."""
    try:
        unquote_to_bytes(request.scope.get("query_string", b"").replace(b"+", b" ")).decode("utf-8")
    except UnicodeDecodeError:
        raise InvalidRequestError("the query string is not valid UTF-8 once its %-escapes are decoded", param="q",
                                  code="invalid_text") from None


def store_of(request: Request) -> MemoryStore:
    m = context_of(request).memory
    if m is None:
        raise MemoryNotFoundError("this server keeps no memory: start it with a --data-dir", code="memory_disabled")
    return m


@router.get("/v1/memory", responses=ERRORS)
async def list_sets(request: Request) -> dict[str, Any]:
    sets = []
    for entry in await off_loop(store_of(request).sets):
        name = unscoped(entry["set"])
        if name is not None:
            sets.append({**entry, "set": name})
    return {"object": "list", "data": sets}


@router.post("/v1/memory/{set_name}", status_code=201, responses=ERRORS)
async def write(body: MemoryWrite, request: Request, set_name: str = SetName) -> JSONResponse:
    check_text(body.texts, "texts")
    check_text(body.metas, "metas")         # stored, then echoed by every listing and search of the set
    ids = await off_loop(store_of(request).add, scoped(set_name), body.texts, body.metas)
    return JSONResponse({"set": set_name, "ids": [f"m_{i}" for i in ids]}, status_code=201)


@router.get("/v1/memory/{set_name}/memories", responses=ERRORS)
async def list_memories(request: Request, set_name: str = SetName,
                        as_of: float | None = Query(None, description="unix time: the set as it was then")) -> dict:
    hits = await off_loop(store_of(request).list, scoped(set_name), as_of=_finite(as_of))
    return {"object": "list", "set": set_name, "as_of": as_of, "data": [h.to_dict() for h in hits]}


@router.get("/v1/memory/{set_name}/search", responses=ERRORS)
async def search(request: Request, set_name: str = SetName, q: str = Query(..., min_length=1, max_length=10_000),
                 k: int = Query(4, ge=1, le=100), as_of: float | None = Query(None)) -> dict:
    _utf8_query(request)
    hits = await off_loop(store_of(request).search, scoped(set_name), q, k, as_of=_finite(as_of))
    return {"object": "list", "set": set_name, "query": q, "as_of": as_of, "data": [h.to_dict() for h in hits]}


@router.delete("/v1/memory/{set_name}/memories/{mid}", responses=ERRORS)
async def forget(request: Request, mid: str, set_name: str = SetName) -> dict:
    if not await off_loop(store_of(request).forget, scoped(set_name), memory_id(mid)):
        raise MemoryNotFoundError(f"no live memory {mid} in {set_name!r}", param="id")
    return {"id": mid, "forgotten": True}


@router.post("/v1/memory/{set_name}/snapshots", status_code=201, responses=ERRORS)
async def snapshot(body: SnapshotRequest, request: Request, set_name: str = SetName) -> JSONResponse:
    snap = await off_loop(store_of(request).snapshot, scoped(set_name), body.name)
    return JSONResponse({**snap, "set": set_name}, status_code=201)


@router.get("/v1/memory/{set_name}/snapshots", responses=ERRORS)
async def snapshots(request: Request, set_name: str = SetName) -> dict:
    return {"object": "list", "data": [{**snap, "set": set_name}
                                       for snap in await off_loop(store_of(request).snapshots, scoped(set_name))]}


@router.post("/v1/memory/{set_name}/snapshots/{name}/restore", responses=ERRORS)
async def restore(request: Request, name: str, set_name: str = SetName) -> dict:
    return {**await off_loop(store_of(request).restore, scoped(set_name), name), "set": set_name}


@router.get("/v1/memory/{node}/chain", responses=ERRORS)
async def chain(node: str, request: Request) -> dict:
    """A memory (``m_<n>``): who wrote and who retrieved it; a response (request id): what it
    retrieved and wrote, and which earlier responses wrote what it retrieved."""
    if node.startswith("m_"):
        found = await off_loop(store_of(request).chain, node)
        name = unscoped(found["set"])
        if name is None:      # another tenant's memory (a unit's shared set is everyone's)
            shared = {b.features.memory_set for b in context_of(request).registry.all()}
            if found["set"] not in shared:
                raise MemoryNotFoundError(f"no memory {node}", param="id")
            name = found["set"]
        mine = [r for r in found["written_by"] if unscoped(r) is not None]
        return {**found, "set": name, "written_by": [unscoped(r) for r in mine],
                "retrieved_by": [{**r, "response": unscoped(r["response"])} for r in found["retrieved_by"]
                                 if unscoped(r["response"]) is not None]}
    found = await off_loop(store_of(request).chain, scoped(node))
    return {**found, "id": node, "influenced_by": [u for r in found["influenced_by"] if (u := unscoped(r)) is not None]}
