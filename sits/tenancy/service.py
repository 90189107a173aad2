"""``Tenancy``: tenants and keys copied in memory from their store, authentication, admission and
settlement, and the usage totals the metrics read.

Everything runs on the gateway's event loop. With the SQLite store one gateway is the authority for
its tenants' limits and budgets (``LocalLedger``); with Redis every gateway sharing it admits against
the same accounts (``RedisLedger``), and hears of each other's directory changes.
"""

from __future__ import annotations

import asyncio
import logging
import sqlite3
import time
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

from sits.engine.errors import SitsError
from sits.tenancy.accounts import RateLimitedError
from sits.tenancy.ledger import AccountRef, Ledger, LocalLedger, Reservation
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
    reservation: Reservation | None        # None: the operator's request, held against nothing
    ledger: Ledger | None = None
    settled: bool = False

    @property
    def headers(self) -> dict[str, str]:
        return self.reservation.headers if self.reservation is not None else {}

    def first_token(self) -> None:
        res = self.reservation
        if res is not None and not res.started and not self.settled:
            res.started = True
            self.ledger.first_token(res)


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
    """The directory (tenants, keys) is copied here from the store, so that authenticating a call
    reads memory; the accounts' running state (in flight, rates, budgets) lives in the ledger."""

    def __init__(self, store, ledger: Ledger, clock=time.time):
        self.store = store                  # TenantStore (SQLite) | RedisTenantStore
        self.ledger = ledger                # LocalLedger | RedisLedger
        self.clock = clock
        self.tenants: dict[str, TenantSpec] = {}
        self.created: dict[str, float] = {}
        self.keys: dict[str, KeyRecord] = {}
        self.totals: dict[tuple[str, str, str], UsageTotals] = defaultdict(UsageTotals)   # (tenant, unit, outcome)
        self.rejections: dict[tuple[str, str], int] = defaultdict(int)                   # (tenant, code)
        self._started = False
        self._reloading = asyncio.Lock()

    @classmethod
    def open(cls, data_dir: str | Path | None, url: str | None = None) -> "Tenancy":
        """SQLite in ``data_dir`` (one gateway), or the Redis at ``url`` (gateways sharing tenants)."""
        if url is None:
            store = TenantStore(Path(data_dir) / "tenants.db")
            return cls(store, LocalLedger(store.spent))
        if not url.startswith(("redis://", "rediss://", "unix://")):
            raise ValueError(f"tenant store {url!r}: expected redis://HOST:PORT/DB (or none for SQLite in the data dir)")
        from sits.tenancy.redis_ledger import RedisLedger
        from sits.tenancy.redis_store import RedisTenantStore, connect
        client = connect(url)
        prefix = "sits:{tenancy}:"
        return cls(RedisTenantStore(client, prefix), RedisLedger(client, prefix))

    async def start(self) -> None:
        """Load the directory and start keeping it current (idempotent: the app and a gateway may both ask)."""
        if self._started:
            return
        self._started = True
        try:
            await self.reload()
            await self.ledger.start()
        except Exception as e:      # a refused connection, a wrong URL, a database that cannot be read
            raise RuntimeError(f"the tenant store cannot be reached ({type(e).__name__}: {e}); a gateway does not "
                               f"start without its keys") from e
        await self.store.watch(self.reload)

    async def aclose(self) -> None:
        await self.ledger.aclose()
        await self.store.aclose()
        redis = getattr(self.store, "redis", None)
        if redis is not None:
            await redis.aclose(close_connection_pool=True)

    async def reload(self) -> None:
        """The directory as the store has it now (a change made by this or another gateway)."""
        async with self._reloading:
            tenants, keys = await self.store.tenants(), await self.store.keys()
        self._install(tenants, keys)

    def _install(self, tenants: list[tuple[TenantSpec, float]], keys: list[KeyRecord]) -> None:
        live: set[AccountRef] = set()
        self.tenants = {spec.name: spec for spec, _ in tenants}
        self.created = {spec.name: created for spec, created in tenants}
        for spec, _ in tenants:
            self.ledger.configure(("tenant", spec.name), spec.limits, spec.budgets)
            live.add(("tenant", spec.name))
        self.keys = {rec.id: rec for rec in keys}
        for rec in keys:
            if rec.revoked_at is None:
                self.ledger.configure(("key", rec.id), rec.spec.limits, rec.spec.budgets)
                live.add(("key", rec.id))
        for ref in self.ledger.refs() - live:
            self.ledger.drop(ref)

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

    async def create_tenant(self, spec: TenantSpec) -> TenantSpec:
        if not await self.store.put_tenant(spec, create=True):
            raise TenantExistsError(f"tenant {spec.name!r} exists; PATCH /v1/tenants/{spec.name} changes it",
                                    param="name")
        await self.reload()
        return spec

    async def update_tenant(self, name: str, update: TenantUpdate) -> TenantSpec:
        spec = self.tenant(name)
        data = spec.model_dump()
        if update.limits is not None:
            data["limits"] = update.limits.model_dump()
        if update.budgets is not None:
            data["budgets"] = [b.model_dump() for b in update.budgets]
        if update.weight is not None:
            data["weight"] = update.weight
        new = TenantSpec.model_validate(data)
        if not await self.store.put_tenant(new, create=False):
            raise TenantNotFoundError(f"no tenant {name!r}", param="tenant")
        await self.reload()
        return new

    async def delete_tenant(self, name: str) -> None:
        self.tenant(name)
        await self.store.delete_tenant(name)
        await self.reload()

    async def create_key(self, tenant: str, spec: KeySpec) -> tuple[KeyRecord, str]:
        self.tenant(tenant)
        rec, key = await self.store.create_key(tenant, spec)
        await self.reload()
        return rec, key

    def key(self, kid: str) -> KeyRecord:
        rec = self.keys.get(kid)
        if rec is None:
            raise KeyNotFoundError(f"no key {kid!r}", param="key_id")
        return rec

    async def rotate_key(self, kid: str) -> tuple[KeyRecord, str]:
        out = await self.store.rotate_key(self.key(kid).id)
        if out is None:
            raise KeyNotFoundError(f"key {kid!r} is revoked", param="key_id")
        await self.reload()
        return out

    async def revoke_key(self, kid: str) -> KeyRecord:
        self.key(kid)
        await self.store.revoke_key(kid)
        await self.reload()
        return self.keys[kid]

    async def account_view(self, kind: str, ident: str) -> dict | None:
        return await self.ledger.view((kind, ident))

    # -- admission and settlement ----------------------------------------------------------------
    @staticmethod
    def _refs(principal: Principal) -> list[AccountRef]:
        return [("key", principal.key_id), ("tenant", principal.tenant)] if principal.tenant is not None else []

    async def admit(self, principal: Principal, unit: str, tokens: int, cost: float) -> Admission:
        """Reserve ``tokens`` / ``cost`` (the request's worst case) on the key's and the tenant's
        accounts, all or none; raises the typed 429 of the first limit or budget that refuses."""
        if principal.tenant is None:
            return Admission(principal, unit, None)
        try:
            res = await self.ledger.admit(self._refs(principal), tokens, cost)
        except RateLimitedError as err:
            self.rejections[(principal.tenant, err.code)] += 1
            raise
        return Admission(principal, unit, res, self.ledger)

    async def check(self, principal: Principal, tokens: int, cost: float = 0.0) -> None:
        """Raise the 429 that admitting ``tokens`` / ``cost`` would meet now, reserving nothing (an
        asynchronous request is checked so before its 202; it is admitted when it runs)."""
        if principal.tenant is None:
            return
        try:
            await self.ledger.check(self._refs(principal), tokens, cost)
        except RateLimitedError as err:
            self.rejections[(principal.tenant, err.code)] += 1
            raise

    def queue_limits(self, principal: Principal) -> list[tuple[str, int]]:
        """(``key`` | ``tenant``, max_queued) of the caller's accounts that set one."""
        out = []
        if principal.tenant is None:
            return out
        key = self.keys.get(principal.key_id)
        for kind, spec in (("key", key.spec if key is not None else None), ("tenant", self.tenants.get(principal.tenant))):
            if spec is not None and spec.limits.max_queued is not None:
                out.append((kind, spec.limits.max_queued))
        return out

    def settle(self, adm: Admission, record: UsageRecord) -> None:
        """What the request really used: its accounts take that instead of the reservation, and it
        is recorded (every request, tenant or not, so usage per unit is complete)."""
        if adm.settled:
            return
        adm.settled = True
        if adm.reservation is not None:
            self.ledger.settle(adm.reservation, record.tokens, record.cost)
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
        if adm.reservation is not None:
            self.ledger.settle(adm.reservation, 0, 0.0)


__all__ = ["Tenancy", "Admission", "OPERATOR", "TenantNotFoundError", "KeyNotFoundError", "TenantExistsError"]
