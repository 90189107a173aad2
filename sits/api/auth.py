"""Who a request is: the operator's static keys (``--api-key``) and, once the server keeps tenants
with keys, the tenants' keys. The edge resolves it once per request; routes read the result."""

from __future__ import annotations

import hmac

from fastapi import Request

from sits.api.context import context_of
from sits.engine.errors import SitsError
from sits.tenancy.principal import OPERATOR, Principal, current_principal


class AdminRequiredError(SitsError):
    code = "admin_required"
    http_status = 403


def keys_match(presented: str, keys: tuple[str, ...]) -> bool:
    """Constant time in the key's content: every configured key is compared, no early exit."""
    ok = False
    p = presented.encode()
    for k in keys:
        ok |= hmac.compare_digest(p, k.encode())
    return ok


class Authenticator:
    def __init__(self, static_keys, tenancy=None):
        """``static_keys``: a callable giving the operator's keys now; ``tenancy``: a ``Tenancy`` or None."""
        self.static_keys = static_keys
        self.tenancy = tenancy

    def required(self) -> bool:
        return bool(self.static_keys()) or (self.tenancy is not None and self.tenancy.active)

    def resolve(self, token: str) -> Principal | None:
        keys = self.static_keys()
        if keys and keys_match(token, keys):
            return OPERATOR
        return self.tenancy.authenticate(token) if self.tenancy is not None else None


def bearer(request: Request) -> str:
    scheme, _, token = request.headers.get("authorization", "").partition(" ")
    return token.strip() if scheme.lower() == "bearer" else ""


def require_operator(request: Request) -> None:
    """The control API and the tenant admin API: open as before while no tenant key exists (the edge
    still checks ``--api-key``), an admin key (or the operator's static key) once one does."""
    tenancy = context_of(request).tenancy
    if tenancy is None or not tenancy.active:
        return
    if not current_principal.get().admin:
        raise AdminRequiredError("this endpoint needs an admin key (a key with role admin, or the server's "
                                 "--api-key)")
