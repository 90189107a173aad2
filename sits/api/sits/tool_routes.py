"""``GET /v1/tools``: the tool contracts this server knows (built-ins and ``--tools-dir``), each
with its OpenAI ``tools`` entry, and which units allow which."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request

from sits.api.context import context_of

router = APIRouter(tags=["sits"])


@router.get("/v1/tools")
async def list_tools(request: Request) -> dict[str, Any]:
    ctx = context_of(request)
    units = {b.name: list(b.features.tools) for b in ctx.registry.all()}
    data = []
    for c in ctx.tools.all():
        allowed_by = sorted(u for u, refs in units.items() if any(c.ref == m.ref for r in refs
                                                                   for m in ctx.tools.matching(r)))
        data.append({"id": c.id, "version": c.version, "ref": c.ref, "description": c.description,
                     "parameters": c.parameters, "timeout_ms": c.timeout_ms, "side_effects": c.side_effects,
                     "quotas": c.quotas.model_dump(), "runtime": c.runtime, "units": allowed_by,
                     "openai": c.to_openai_tool()})
    return {"object": "list", "data": data}
