"""Tenants and their keys (``/v1/tenants``, ``/v1/keys``: admin), and usage (``/v1/usage``: a
tenant's own, or everyone's for an admin). A new or rotated key is shown once, in that answer."""

from __future__ import annotations

import csv
import io
from typing import Any, Literal

from fastapi import APIRouter, Depends, Query, Request
from fastapi.responses import JSONResponse, Response

from sits.api.auth import require_operator
from sits.api.context import context_of
from sits.api.errors import error_docs
from sits.engine.errors import InvalidRequestError, SitsError
from sits.tenancy.principal import current_principal
from sits.tenancy.service import Tenancy
from sits.tenancy.spec import KeySpec, TenantSpec, TenantUpdate
from sits.tenancy.store import UsageRecord


class TenantsDisabledError(SitsError):
    code = "tenants_disabled"
    http_status = 404


ERRORS = error_docs({
    400: "invalid tenant or key settings",
    401: "missing or wrong API key",
    403: "an admin key is needed",
    404: "no such tenant or key, or this server keeps no tenants",
    409: "the tenant exists",
})
admin = APIRouter(tags=["tenants"], dependencies=[Depends(require_operator)], responses=ERRORS)
usage_router = APIRouter(tags=["tenants"], responses=ERRORS)


def tenancy_of(request: Request) -> Tenancy:
    t = context_of(request).tenancy
    if t is None:
        raise TenantsDisabledError("this server keeps no tenants: start it with a --data-dir")
    return t   # type: ignore[return-value]


async def _tenant_view(t: Tenancy, name: str) -> dict[str, Any]:
    spec = t.tenant(name)
    return {"object": "tenant", "name": name, "created_at": t.created.get(name), "weight": spec.weight,
            **(await t.account_view("tenant", name) or {}),
            "keys": sum(1 for k in t.keys.values() if k.tenant == name and k.revoked_at is None)}


async def _key_view(t: Tenancy, kid: str) -> dict[str, Any]:
    rec = t.key(kid)
    view = rec.view()
    if (acct := await t.account_view("key", kid)) is not None:
        view |= {k: v for k, v in acct.items() if k != "limits"}
    return view


@admin.post("/v1/tenants", status_code=201)
async def create_tenant(body: TenantSpec, request: Request) -> JSONResponse:
    t = tenancy_of(request)
    await t.create_tenant(body)
    return JSONResponse(await _tenant_view(t, body.name), status_code=201)


@admin.get("/v1/tenants")
async def list_tenants(request: Request) -> dict[str, Any]:
    t = tenancy_of(request)
    return {"object": "list", "data": [await _tenant_view(t, n) for n in sorted(t.tenants)]}


@admin.get("/v1/tenants/{name}")
async def get_tenant(name: str, request: Request) -> dict[str, Any]:
    return await _tenant_view(tenancy_of(request), name)


@admin.patch("/v1/tenants/{name}")
async def update_tenant(name: str, body: TenantUpdate, request: Request) -> dict[str, Any]:
    t = tenancy_of(request)
    await t.update_tenant(name, body)
    return await _tenant_view(t, name)


@admin.delete("/v1/tenants/{name}")
async def delete_tenant(name: str, request: Request) -> dict[str, Any]:
    await tenancy_of(request).delete_tenant(name)
    return {"name": name, "deleted": True}


@admin.post("/v1/tenants/{name}/keys", status_code=201)
async def create_key(name: str, body: KeySpec, request: Request) -> JSONResponse:
    t = tenancy_of(request)
    rec, key = await t.create_key(name, body)
    return JSONResponse({**await _key_view(t, rec.id), "key": key}, status_code=201)


@admin.get("/v1/keys")
async def list_keys(request: Request, tenant: str | None = None,
                    revoked: bool = Query(False, description="include revoked keys")) -> dict[str, Any]:
    t = tenancy_of(request)
    return {"object": "list", "data": [await _key_view(t, k.id) for k in list(t.keys.values())
                                       if (tenant is None or k.tenant == tenant) and (revoked or k.revoked_at is None)]}


@admin.get("/v1/keys/{kid}")
async def get_key(kid: str, request: Request) -> dict[str, Any]:
    return await _key_view(tenancy_of(request), kid)


@admin.post("/v1/keys/{kid}/rotate")
async def rotate_key(kid: str, request: Request) -> dict[str, Any]:
    t = tenancy_of(request)
    rec, key = await t.rotate_key(kid)
    return {**await _key_view(t, rec.id), "key": key}


@admin.delete("/v1/keys/{kid}")
async def revoke_key(kid: str, request: Request) -> dict[str, Any]:
    t = tenancy_of(request)
    return (await t.revoke_key(kid)).view()


_SUMS = ("prompt_tokens", "cached_tokens", "completion_tokens", "flops", "kv_block_seconds", "gb_hours", "cold_starts",
         "cost")


def aggregate(rows: list[UsageRecord], group_by: tuple[str, ...]) -> list[dict[str, Any]]:
    groups: dict[tuple, dict[str, Any]] = {}
    for r in rows:
        key = tuple(getattr(r, g) for g in group_by)
        g = groups.get(key)
        if g is None:
            g = groups[key] = {**dict(zip(group_by, key)), "requests": 0, **{s: 0 for s in _SUMS}}
        g["requests"] += r.outcome != "instance"       # an instance's memory-time rows are not requests
        for s in _SUMS:
            g[s] += getattr(r, s)
    out = []
    for g in groups.values():
        g["total_tokens"] = g["prompt_tokens"] + g["completion_tokens"]
        g["cost"] = round(g["cost"], 9)
        g["kv_block_seconds"] = round(g["kv_block_seconds"], 6)
        g["gb_hours"] = round(g["gb_hours"], 9)
        out.append(g)
    return sorted(out, key=lambda g: tuple(str(g[k]) for k in group_by))


@usage_router.get("/v1/usage")
async def usage(request: Request, tenant: str | None = None, key_id: str | None = None, unit: str | None = None,
                start: float | None = Query(None, description="unix time, inclusive"),
                end: float | None = Query(None, description="unix time, exclusive"),
                group_by: str = Query("tenant,unit", description="comma-separated: tenant, key_id, unit, or "
                                      "request_id (one row per request)"),
                format: Literal["json", "csv"] = "json") -> Response:
    """Tokens, FLOPs, KV block-seconds, instance GB-hours (apportioned by busy time), cold starts caused
    and cost, summed per group. A tenant's key sees its own tenant only."""
    t = tenancy_of(request)
    principal = current_principal.get()
    if not principal.admin:
        tenant = principal.tenant
    groups = tuple(g.strip() for g in group_by.split(",") if g.strip())
    bad = [g for g in groups if g not in ("tenant", "key_id", "unit", "request_id")]
    if bad:
        raise InvalidRequestError(f"group_by: {', '.join(bad)} is not one of tenant, key_id, unit, request_id",
                                  param="group_by", code="invalid_parameter")
    rows = aggregate(await t.store.usage(tenant=tenant, key_id=key_id, unit=unit, start=start, end=end), groups)
    if format == "csv":
        buf = io.StringIO()
        fields = [*groups, "requests", "prompt_tokens", "cached_tokens", "completion_tokens", "total_tokens", "flops",
                  "kv_block_seconds", "gb_hours", "cold_starts", "cost"]
        w = csv.DictWriter(buf, fieldnames=fields)
        w.writeheader()
        w.writerows(rows)
        return Response(buf.getvalue(), media_type="text/csv")
    return JSONResponse({"object": "list", "group_by": list(groups), "start": start, "end": end, "data": rows})
