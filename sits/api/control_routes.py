"""The control API of ``sits up``: deploy, list, delete and scale units; the runtime's status.

Bodies are validated with the runtime's ``UnitSpec`` (unknown fields are errors here, not
warnings: a typo in a deployment must not pass silently).
"""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field

from sits.api.auth import require_operator
from sits.api.errors import clip, error_docs
from sits.engine.errors import SitsError
from sits.runtime.gateway import Gateway
from sits.runtime.unit_spec import UnitSpec

router = APIRouter(tags=["control"], dependencies=[Depends(require_operator)])

ERRORS = error_docs({
    400: "invalid unit spec",
    401: "missing or wrong API key",
    403: "an admin key is needed (once the server has tenant keys)",
    404: "no such unit",
})


class UnitNotFoundError(SitsError):
    code = "unit_not_found"
    http_status = 404


class ScaleRequest(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    instances: int = Field(..., ge=0, le=64)


def _gateway(request: Request) -> Gateway:
    return request.app.state.gateway


def unit_or_404(gw: Gateway, name: str):
    try:
        return gw.units[name]
    except KeyError:
        raise UnitNotFoundError(f"no unit {clip(name)}; deployed: {', '.join(sorted(gw.units)) or 'none'}",
                                param="name") from None


@router.get("/v1/units", responses=ERRORS)
async def list_units(request: Request) -> dict[str, Any]:
    return {"object": "list", "data": [b.view() for b in _gateway(request).units.values()]}


@router.post("/v1/units", status_code=201, responses=ERRORS)
async def deploy_unit(spec: UnitSpec, request: Request) -> JSONResponse:
    gw = _gateway(request)
    replaced = spec.name in gw.units
    backend = await gw.deploy(spec)
    return JSONResponse(backend.view(), status_code=200 if replaced else 201)


@router.get("/v1/units/{name}", responses=ERRORS)
async def get_unit(name: str, request: Request) -> dict[str, Any]:
    return unit_or_404(_gateway(request), name).view()


@router.delete("/v1/units/{name}", responses=ERRORS)
async def delete_unit(name: str, request: Request) -> dict[str, Any]:
    gw = _gateway(request)
    unit_or_404(gw, name)
    await gw.undeploy(name)
    return {"name": name, "deleted": True}


@router.post("/v1/units/{name}/scale", responses=ERRORS)
async def scale_unit(name: str, body: ScaleRequest, request: Request) -> dict[str, Any]:
    gw = _gateway(request)
    unit_or_404(gw, name)
    return gw.scale(name, body.instances).view()


@router.get("/v1/status", responses=ERRORS)
async def status(request: Request) -> dict[str, Any]:
    return _gateway(request).status()


@router.get("/v1/sla", responses=ERRORS)
async def sla(request: Request) -> dict[str, Any]:
    """Per unit: the TTFT SLO, attainment over the window, the breaker's state and trips."""
    rows = []
    for name, b in _gateway(request).units.items():
        rows.append({"unit": name, **b.breaker.view(), "fallback": b.spec.fallback, "fallbacks": b.fallbacks})
    return {"object": "list", "data": rows}
