"""``Tenancy``: tenants and keys in memory over their SQLite store, authentication, admission and
settlement, and the usage totals the metrics read.

Everything runs on the gateway's event loop (the store is written synchronously: a usage row is one
small insert in WAL mode). One gateway is the authority for its tenants' limits and budgets.
"""

from __future__ import annotations

import logging
import sqlite3
import time
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path

from sits.engine.errors import SitsError
from sits.tenancy.accounts import Account
from sits.tenancy.principal import OPERATOR, Principal
from sits.tenancy.spec import KeySpec, TenantSpec, TenantUpdate
from sits.tenancy.store import KeyRecord, TenantStore, UsageRecord, split_key

log = logging.getLogger("sits.tenancy")


class TenantNotFoundError(SitsError):
    code = "tenant_not_found"
    http_status = 404


class KeyNotFoundError(SitsError):
    code = "key_not_found"
    http_status = 404


class TenantExistsError(SitsError):
    code = "tenant_exists"
    http_status = 409


@dataclass
class Admission:
    """A request's reservation on its accounts: settled exactly once (``Tenancy.settle``)."""

    principal: Principal
    unit: str
    accounts: list[Account]
    tokens: int                      # the reserved worst case
    cost: float
    headers: dict[str, str] = field(default_factory=dict)
    started: bool = False
    settled: bool = False

    def first_token(self) -> None:
        if not self.started and not self.settled:
            self.started = True
            for a in self.accounts:
                a.started()


@dataclass
class UsageTotals:
    requests: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    completion_tokens: int = 0
    flops: float = 0.0
    kv_block_seconds: float = 0.0
    gb_hours: float = 0.0
    cold_starts: int = 0
    cost: float = 0.0


class Tenancy:
    def __init__(self, store: TenantStore, clock=time.time):
        self.store = store
        self.clock = clock
        self.tenants: dict[str, TenantSpec] = {}
        self.created: dict[str, float] = {}
        self.keys: dict[str, KeyRecord] = {}
        self.accounts: dict[tuple[str, str], Account] = {}
        self.totals: dict[tuple[str, str, str], UsageTotals] = defaultdict(UsageTotals)   # (tenant, unit, outcome)
        self.rejections: dict[tuple[str, str], int] = defaultdict(int)                   # (tenant, code)
        now = clock()
        for spec, created in store.tenants():
            self.tenants[spec.name] = spec
            self.created[spec.name] = created
            self.accounts[("tenant", spec.name)] = Account.new("tenant", spec.name, spec.limits, spec.budgets, now,
                                                               self._spent("tenant", spec.name))
        for rec in store.keys():
            self.keys[rec.id] = rec
            if rec.revoked_at is None:
                self.accounts[("key", rec.id)] = Account.new("key", rec.id, rec.spec.limits, rec.spec.budgets, now,
                                                             self._spent("key_id", rec.id))

    @classmethod
    def open(cls, data_dir: str | Path) -> "Tenancy":
        return cls(TenantStore(Path(data_dir) / "tenants.db"))

    def close(self) -> None:
        self.store.close()

    def _spent(self, column: str, ident: str):
        return lambda budget, since: self.store.spent(column, ident, since)

    @property
    def active(self) -> bool:
        """Once any live key exists, every /v1 call needs a key and the control API an admin key."""
        return any(r.revoked_at is None for r in self.keys.values())

    # -- who is calling --------------------------------------------------------------------------
    def authenticate(self, presented: str) -> Principal | None:
        parts = split_key(presented)
        if parts is None:
            return None
        rec = self.keys.get(parts[0])
        if rec is None or rec.revoked_at is not None or not TenantStore.secret_matches(rec, parts[1]):
            return None
        return Principal(tenant=rec.tenant, key_id=rec.id, admin=rec.spec.role == "admin",
                         units=None if rec.spec.units is None else frozenset(rec.spec.units))

    # -- tenants and keys ------------------------------------------------------------------------
    def tenant(self, name: str) -> TenantSpec:
        try:
            return self.tenants[name]
        except KeyError:
            raise TenantNotFoundError(f"no tenant {name!r}", param="tenant") from None

    def weight(self, name: str) -> float:
        spec = self.tenants.get(name)
        return spec.weight if spec is not None else 1.0

    def create_tenant(self, spec: TenantSpec) -> TenantSpec:
        if not self.store.put_tenant(spec, create=True):
            raise TenantExistsError(f"tenant {spec.name!r} exists; PATCH /v1/tenants/{spec.name} changes it",
                                    param="name")
        self.tenants[spec.name] = spec
        self.created[spec.name] = self.clock()
        self.accounts[("tenant", spec.name)] = Account.new("tenant", spec.name, spec.limits, spec.budgets,
                                                           self.clock(), self._spent("tenant", spec.name))
        return spec

    def update_tenant(self, name: str, update: TenantUpdate) -> TenantSpec:
        spec = self.tenant(name)
        data = spec.model_dump()
        if update.limits is not None:
            data["limits"] = update.limits.model_dump()
        if update.budgets is not None:
            data["budgets"] = [b.model_dump() for b in update.budgets]
        if update.weight is not None:
            data["weight"] = update.weight
        new = TenantSpec.model_validate(data)
        self.store.put_tenant(new, create=False)
        self.tenants[name] = new
        self.accounts[("tenant", name)].configure(new.limits, new.budgets, self.clock(), self._spent("tenant", name))
        return new

    def delete_tenant(self, name: str) -> None:
        self.tenant(name)
        self.store.delete_tenant(name)
        del self.tenants[name]
        self.accounts.pop(("tenant", name), None)
        for rec in self.store.keys():
            if rec.tenant == name:
                self.keys[rec.id] = rec
                self.accounts.pop(("key", rec.id), None)

    def create_key(self, tenant: str, spec: KeySpec) -> tuple[KeyRecord, str]:
        self.tenant(tenant)
        rec, key = self.store.create_key(tenant, spec)
        self.keys[rec.id] = rec
        self.accounts[("key", rec.id)] = Account.new("key", rec.id, spec.limits, spec.budgets, self.clock(),
                                                     self._spent("key_id", rec.id))
        return rec, key

    def key(self, kid: str) -> KeyRecord:
        rec = self.keys.get(kid)
        if rec is None:
            raise KeyNotFoundError(f"no key {kid!r}", param="key_id")
        return rec

    def rotate_key(self, kid: str) -> tuple[KeyRecord, str]:
        out = self.store.rotate_key(self.key(kid).id)
        if out is None:
            raise KeyNotFoundError(f"key {kid!r} is revoked", param="key_id")
        self.keys[kid] = out[0]
        return out

    def revoke_key(self, kid: str) -> KeyRecord:
        self.key(kid)
        self.store.revoke_key(kid)
        self.keys[kid] = next(r for r in self.store.keys() if r.id == kid)
        self.accounts.pop(("key", kid), None)
        return self.keys[kid]

    def account_view(self, kind: str, ident: str) -> dict | None:
        acct = self.accounts.get((kind, ident))
        if acct is None:
            return None
        now = self.clock()
        acct.roll(now, self._spent("tenant" if kind == "tenant" else "key_id", ident))
        return acct.view(now)

    # -- admission and settlement ----------------------------------------------------------------
    def admit(self, principal: Principal, unit: str, tokens: int, cost: float) -> Admission:
        """Reserve ``tokens`` / ``cost`` (the request's worst case) on the key's and the tenant's
        accounts, all or none; raises the typed 429 of the first limit or budget that refuses."""
        if principal.tenant is None:
            return Admission(principal, unit, [], tokens, cost)
        self.check(principal, tokens, cost)          # no await between the check and the reservation
        now = self.clock()
        accounts = self._accounts_of(principal, now)
        for acct in accounts:
            acct.reserve(tokens, cost)
        headers = next((h for a in accounts if (h := a.rate_headers(now))), {})
        return Admission(principal, unit, accounts, tokens, cost, headers)

    def check(self, principal: Principal, tokens: int, cost: float = 0.0) -> None:
        """Raise the 429 that admitting ``tokens`` / ``cost`` would meet now, reserving nothing (an
        asynchronous request is checked so before its 202; it is admitted when it runs)."""
        now = self.clock()
        for acct in self._accounts_of(principal, now):
            err = acct.refusal(tokens, cost, now)
            if err is not None:
                self.rejections[(principal.tenant, err.code)] += 1
                err.headers = acct.rate_headers(now)
                raise err

    def _accounts_of(self, principal: Principal, now: float) -> list[Account]:
        """The caller's key and tenant accounts (none for the operator), their budget periods current."""
        out = []
        if principal.tenant is None:
            return out
        for kind, ident, column in (("key", principal.key_id, "key_id"), ("tenant", principal.tenant, "tenant")):
            acct = self.accounts.get((kind, ident))
            if acct is not None:
                acct.roll(now, self._spent(column, ident))
                out.append(acct)
        return out

    def queue_limits(self, principal: Principal) -> list[tuple[str, int]]:
        """(``key`` | ``tenant``, max_queued) of the caller's accounts that set one."""
        out = []
        for kind, ident in (("key", principal.key_id), ("tenant", principal.tenant)):
            acct = self.accounts.get((kind, ident))
            if acct is not None and acct.limits.max_queued is not None:
                out.append((kind, acct.limits.max_queued))
        return out

    def settle(self, adm: Admission, record: UsageRecord) -> None:
        """What the request really used: its accounts take that instead of the reservation, and it
        is recorded (every request, tenant or not, so usage per unit is complete)."""
        if adm.settled:
            return
        adm.settled = True
        for a in adm.accounts:
            a.settle(adm.tokens, adm.cost, record.tokens, record.cost, adm.started)
        self._record([record])
        t = self.totals[(record.tenant or "", record.unit, record.outcome)]
        t.requests += 1
        t.prompt_tokens += record.prompt_tokens
        t.cached_tokens += record.cached_tokens
        t.completion_tokens += record.completion_tokens
        t.flops += record.flops
        t.kv_block_seconds += record.kv_block_seconds
        t.cold_starts += record.cold_starts
        t.cost += record.cost

    def record_instance(self, unit: str, instance: str, shares: list[tuple[str | None, float]],
                        per_gb_hour: float) -> None:
        """An instance's memory-time, apportioned (``InstanceMeter.close``), as usage rows of outcome
        ``instance`` (attributed and priced; not held against budgets, which a request reserves)."""
        now = self.clock()
        rows = [UsageRecord(at=now, request_id=instance, tenant=t, key_id=None, unit=unit, outcome="instance",
                            prompt_tokens=0, cached_tokens=0, completion_tokens=0, flops=0.0, kv_block_seconds=0.0,
                            gb_hours=gb, cost=gb * per_gb_hour) for t, gb in shares if gb > 0]
        self._record(rows)
        for r in rows:
            tot = self.totals[(r.tenant or "", unit, "instance")]
            tot.gb_hours += r.gb_hours
            tot.cost += r.cost

    def _record(self, rows: list[UsageRecord]) -> None:
        """A usage row that cannot be written (disk full, a locked database) is logged; the request
        it describes has been served and its accounts are settled in memory either way."""
        try:
            self.store.record(rows)
        except sqlite3.Error:
            log.exception("usage rows not recorded (%d)", len(rows))

    def release(self, adm: Admission) -> None:
        """A reservation whose request never ran: nothing spent, nothing recorded."""
        if adm.settled:
            return
        adm.settled = True
        for a in adm.accounts:
            a.settle(adm.tokens, adm.cost, 0, 0.0, adm.started)


__all__ = ["Tenancy", "Admission", "OPERATOR", "TenantNotFoundError", "KeyNotFoundError", "TenantExistsError"]
