"""``/v1/memory``: memory sets (write, list and search as of a time, forget), snapshots and their
restore, and the causal chain of a memory or a response. Embedding runs off the event loop."""

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
    return {"object": "list", "data": await off_loop(store_of(request).sets)}


@router.post("/v1/memory/{set_name}", status_code=201, responses=ERRORS)
async def write(body: MemoryWrite, request: Request, set_name: str = SetName) -> JSONResponse:
    check_text(body.texts, "texts")
    check_text(body.metas, "metas")         # stored, then echoed by every listing and search of the set
    ids = await off_loop(store_of(request).add, set_name, body.texts, body.metas)
    return JSONResponse({"set": set_name, "ids": [f"m_{i}" for i in ids]}, status_code=201)


@router.get("/v1/memory/{set_name}/memories", responses=ERRORS)
async def list_memories(request: Request, set_name: str = SetName,
                        as_of: float | None = Query(None, description="unix time: the set as it was then")) -> dict:
    hits = await off_loop(store_of(request).list, set_name, as_of=_finite(as_of))
    return {"object": "list", "set": set_name, "as_of": as_of, "data": [h.to_dict() for h in hits]}


@router.get("/v1/memory/{set_name}/search", responses=ERRORS)
async def search(request: Request, set_name: str = SetName, q: str = Query(..., min_length=1, max_length=10_000),
                 k: int = Query(4, ge=1, le=100), as_of: float | None = Query(None)) -> dict:
    _utf8_query(request)
    hits = await off_loop(store_of(request).search, set_name, q, k, as_of=_finite(as_of))
    return {"object": "list", "set": set_name, "query": q, "as_of": as_of, "data": [h.to_dict() for h in hits]}


@router.delete("/v1/memory/{set_name}/memories/{mid}", responses=ERRORS)
async def forget(request: Request, mid: str, set_name: str = SetName) -> dict:
    if not await off_loop(store_of(request).forget, set_name, memory_id(mid)):
        raise MemoryNotFoundError(f"no live memory {mid} in {set_name!r}", param="id")
    return {"id": mid, "forgotten": True}


@router.post("/v1/memory/{set_name}/snapshots", status_code=201, responses=ERRORS)
async def snapshot(body: SnapshotRequest, request: Request, set_name: str = SetName) -> JSONResponse:
    return JSONResponse(await off_loop(store_of(request).snapshot, set_name, body.name), status_code=201)


@router.get("/v1/memory/{set_name}/snapshots", responses=ERRORS)
async def snapshots(request: Request, set_name: str = SetName) -> dict:
    return {"object": "list", "data": await off_loop(store_of(request).snapshots, set_name)}


@router.post("/v1/memory/{set_name}/snapshots/{name}/restore", responses=ERRORS)
async def restore(request: Request, name: str, set_name: str = SetName) -> dict:
    return await off_loop(store_of(request).restore, set_name, name)


@router.get("/v1/memory/{node}/chain", responses=ERRORS)
async def chain(node: str, request: Request) -> dict:
    """A memory (``m_<n>``): who wrote and who retrieved it; a response (request id): what it
    retrieved and wrote, and which earlier responses wrote what it retrieved."""
    return await off_loop(store_of(request).chain, node)
