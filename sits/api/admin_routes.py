"""Admin endpoints of ``sits up``: fault injection switched at run time.

Off unless the server was started with an admin key (``--admin-key`` / ``SITS_ADMIN_KEY``): then
403 ``admin_disabled``. With one, every call needs ``Authorization: Bearer <admin key>`` (checked in
constant time; the API keys do not open these). They live outside ``/v1`` so that API keys and
admin keys never overlap, and callback URLs on private hosts (this server included) are refused
by default, so a webhook cannot be aimed at them.
"""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Depends, Request

from sits.api.context import context_of
from sits.api.control_routes import unit_or_404
from sits.api.auth import bearer, keys_match
from sits.api.errors import AuthenticationError, error_docs
from sits.engine.errors import SitsError
from sits.faults import FaultsSpec
from sits.observe.tracing import spans_as_dicts
from sits.runtime.gateway import Gateway


class AdminDisabledError(SitsError):
    code = "admin_disabled"
    http_status = 403


def require_admin(request: Request) -> None:
    ctx = context_of(request)
    keys = ctx.settings.admin_keys
    tenancy = ctx.tenancy
    if tenancy is not None and tenancy.active:      # a tenant key with role admin opens them too
        principal = tenancy.authenticate(bearer(request))
        if principal is not None and principal.admin:
            return
    if not keys:
        raise AdminDisabledError("the admin endpoints are off; start the server with --admin-key "
                                 "(or SITS_ADMIN_KEY) to use them")
    if not keys_match(bearer(request), keys):
        raise AuthenticationError("invalid or missing admin key: send Authorization: Bearer <admin key>",
                                  code="invalid_admin_key")


ERRORS = error_docs({
    401: "missing or wrong admin key",
    403: "admin endpoints are off (no admin key configured)",
    404: "no such unit",
})
router = APIRouter(prefix="/admin", tags=["admin"], dependencies=[Depends(require_admin)], responses=ERRORS)


def _gateway(request: Request) -> Gateway:
    return request.app.state.gateway


def _unit(request: Request, name: str):
    return unit_or_404(_gateway(request), name)


@router.get("/faults")
async def list_faults(request: Request) -> dict[str, Any]:
    """Every unit's faults: what is injected, how often each acted, which instances they hit."""
    return {"object": "list", "data": [{"unit": n, **b.faults.view()} for n, b in _gateway(request).units.items()]}


@router.get("/faults/{unit}")
async def get_faults(unit: str, request: Request) -> dict[str, Any]:
    return {"unit": unit, **_unit(request, unit).faults.view()}


@router.put("/faults/{unit}")
async def set_faults(unit: str, body: FaultsSpec, request: Request) -> dict[str, Any]:
    """Replace the unit's faults (a fresh seeded stream; instance faults are re-assigned)."""
    b = _unit(request, unit)
    b.set_faults(body)
    return {"unit": unit, **b.faults.view()}


@router.delete("/faults/{unit}")
async def clear_faults(unit: str, request: Request) -> dict[str, Any]:
    b = _unit(request, unit)
    b.set_faults(None)
    return {"unit": unit, **b.faults.view()}


@router.get("/traces")
async def recent_traces(request: Request, trace_id: str | None = None, limit: int = 20) -> dict[str, Any]:
    """Traces kept by the in-memory exporter (``--trace-exporter memory``): the latest ``limit``
    traces, or one by ``trace_id``; each span with its start offset and duration in ms."""
    tr = context_of(request).tracing
    if tr is None or tr.memory is None:
        raise AdminDisabledError("no in-memory traces: start the server with --trace-exporter memory",
                                 code="traces_not_kept")
    by_trace: dict[str, list] = {}
    for s in tr.finished_spans():
        by_trace.setdefault(f"{s.context.trace_id:032x}", []).append(s)
    if trace_id is not None:
        picked = {trace_id: by_trace.get(trace_id, [])}
    else:
        picked = dict(list(by_trace.items())[-max(1, min(limit, 500)):])
    return {"object": "list", "data": [{"trace_id": t, "spans": list(spans_as_dicts(spans))}
                                       for t, spans in picked.items()]}
