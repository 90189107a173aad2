"""Who a request comes from: resolved from its Bearer key by the edge, carried in a context variable
(it follows the request into the tasks it spawns, as the routing hints do)."""

from __future__ import annotations

import contextvars
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Principal:
    tenant: str | None            # None: the operator's static key (``--api-key``) or an open server
    key_id: str | None
    admin: bool                   # may use the control API, manage tenants and keys, read all usage
    units: frozenset[str] | None = None   # units/models this key may call; None: all

    def may_call(self, unit: str) -> bool:
        return self.units is None or unit in self.units

    def scoped(self, object_id: str) -> str:
        """The id under which this caller's object is stored: a tenant's requests, responses and
        sessions live in its own namespace, so another tenant's id is simply not found."""
        return object_id if self.tenant is None else f"{self.tenant}/{object_id}"


OPERATOR = Principal(tenant=None, key_id=None, admin=True)

current_principal: contextvars.ContextVar[Principal] = contextvars.ContextVar("sits_principal", default=OPERATOR)


def scoped(object_id: str) -> str:
    """``object_id`` in the namespace of the current request's tenant (unchanged without tenants)."""
    return current_principal.get().scoped(object_id)


def unscoped(stored_id: str) -> str | None:
    """The client's id of a stored one if it lies in the current caller's namespace, else None."""
    tenant = current_principal.get().tenant
    if tenant is None:
        return None if "/" in stored_id else stored_id
    prefix = f"{tenant}/"
    return stored_id[len(prefix):] if stored_id.startswith(prefix) else None


@dataclass(slots=True)
class RequestCharges:
    """What the runtime charges a request besides its tokens (filled in where it happens)."""

    cold_starts: int = 0


current_charges: contextvars.ContextVar[RequestCharges | None] = contextvars.ContextVar("sits_charges", default=None)
