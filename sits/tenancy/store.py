"""Tenants, keys and usage records in SQLite (``<data-dir>/tenants.db``), for one gateway
(``redis_store.py`` for several). The directory methods are coroutines like the Redis store's;
they are small local queries.

Keys are stored as the SHA-256 of their secret (256 random bits: a slow hash adds nothing) and
shown once, at creation or rotation. Usage rows are the record of what every request used and
cost; the budgets' settled spend is summed from them when the gateway starts.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
import sqlite3
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from sits.tenancy.spec import KeySpec, TenantSpec

KEY_PREFIX = "sits_"

_SCHEMA = """
CREATE TABLE IF NOT EXISTS tenants (name TEXT PRIMARY KEY, created_at REAL NOT NULL, spec TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS keys (id TEXT PRIMARY KEY, tenant TEXT NOT NULL, hash TEXT NOT NULL,
    spec TEXT NOT NULL, created_at REAL NOT NULL, revoked_at REAL, last4 TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS usage (seq INTEGER PRIMARY KEY AUTOINCREMENT, at REAL NOT NULL, request_id TEXT,
    tenant TEXT, key_id TEXT, unit TEXT NOT NULL, outcome TEXT NOT NULL, prompt_tokens INTEGER NOT NULL,
    cached_tokens INTEGER NOT NULL, completion_tokens INTEGER NOT NULL, flops REAL NOT NULL,
    kv_block_seconds REAL NOT NULL, gb_hours REAL NOT NULL, cost REAL NOT NULL, cold_starts INTEGER NOT NULL DEFAULT 0);
CREATE INDEX IF NOT EXISTS usage_tenant_at ON usage (tenant, at);
CREATE INDEX IF NOT EXISTS usage_key_at ON usage (key_id, at);
"""


@dataclass(frozen=True, slots=True)
class KeyRecord:
    id: str
    tenant: str
    hash: str
    spec: KeySpec
    created_at: float
    revoked_at: float | None
    last4: str

    def view(self) -> dict[str, Any]:
        """What listing shows: never the secret or its hash."""
        return {"id": self.id, "object": "api_key", "tenant": self.tenant, "name": self.spec.name,
                "role": self.spec.role, "units": self.spec.units, "limits": self.spec.limits.model_dump(exclude_none=True),
                "budgets": [b.model_dump(exclude_none=True) for b in self.spec.budgets],
                "created_at": self.created_at, "revoked_at": self.revoked_at, "redacted": f"{KEY_PREFIX}{self.id}_…{self.last4}"}


@dataclass(frozen=True, slots=True)
class UsageRecord:
    at: float
    request_id: str
    tenant: str | None
    key_id: str | None
    unit: str
    outcome: str                 # finished | aborted | failed
    prompt_tokens: int
    cached_tokens: int
    completion_tokens: int
    flops: float
    kv_block_seconds: float
    gb_hours: float
    cost: float
    cold_starts: int = 0         # instance starts this request asked for and waited on

    @property
    def tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens


USAGE_FIELDS = tuple(UsageRecord.__dataclass_fields__)


def hash_secret(secret: str) -> str:
    return hashlib.sha256(secret.encode()).hexdigest()


def split_key(presented: str) -> tuple[str, str] | None:
    """``sits_<id>_<secret>`` → (id, secret); None for anything else."""
    if not presented.startswith(KEY_PREFIX):
        return None
    kid, sep, secret = presented[len(KEY_PREFIX):].partition("_")
    if not sep or len(kid) != 12 or not secret:
        return None
    return kid, secret


class TenantStore:
    def __init__(self, path: str | Path):
        self.path = str(path)
        self._db = sqlite3.connect(self.path, check_same_thread=False, isolation_level=None)
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.execute("PRAGMA synchronous=NORMAL")
        self._db.executescript(_SCHEMA)
        columns = {row[1] for row in self._db.execute("PRAGMA table_info(usage)")}
        if "cold_starts" not in columns:        # a database from before cold starts were recorded
            self._db.execute("ALTER TABLE usage ADD COLUMN cold_starts INTEGER NOT NULL DEFAULT 0")
        self._lock = threading.Lock()

    def close(self) -> None:
        with self._lock:
            self._db.close()

    async def aclose(self) -> None:
        self.close()

    async def watch(self, on_change) -> None:
        """One gateway owns a data directory's store: nobody else changes it."""

    async def flush(self) -> None:
        """Rows are written as they are recorded."""

    # -- tenants --------------------------------------------------------------------------------
    async def tenants(self) -> list[tuple[TenantSpec, float]]:
        with self._lock:
            rows = self._db.execute("SELECT spec, created_at FROM tenants ORDER BY name").fetchall()
        return [(TenantSpec.model_validate_json(s), t) for s, t in rows]

    async def put_tenant(self, spec: TenantSpec, *, create: bool) -> bool:
        """Insert (``create``: False when the name exists) or replace (False when it does not)."""
        with self._lock:
            if create:
                cur = self._db.execute("INSERT OR IGNORE INTO tenants VALUES (?, ?, ?)",
                                       (spec.name, time.time(), spec.model_dump_json()))
            else:
                cur = self._db.execute("UPDATE tenants SET spec = ? WHERE name = ?", (spec.model_dump_json(), spec.name))
            return cur.rowcount == 1

    async def delete_tenant(self, name: str) -> bool:
        """Removes the tenant and revokes its keys; its usage records stay."""
        with self._lock:
            self._db.execute("BEGIN IMMEDIATE")
            cur = self._db.execute("DELETE FROM tenants WHERE name = ?", (name,))
            self._db.execute("UPDATE keys SET revoked_at = ? WHERE tenant = ? AND revoked_at IS NULL", (time.time(), name))
            self._db.execute("COMMIT")
            return cur.rowcount == 1

    # -- keys -----------------------------------------------------------------------------------
    async def keys(self) -> list[KeyRecord]:
        with self._lock:
            rows = self._db.execute("SELECT id, tenant, hash, spec, created_at, revoked_at, last4 FROM keys "
                                    "ORDER BY created_at").fetchall()
        return [KeyRecord(i, t, h, KeySpec.model_validate_json(s), c, r, l4) for i, t, h, s, c, r, l4 in rows]

    async def create_key(self, tenant: str, spec: KeySpec) -> tuple[KeyRecord, str]:
        """A new key for ``tenant``; returns its record and the key itself (shown once)."""
        kid, secret = secrets.token_hex(6), secrets.token_urlsafe(32)
        rec = KeyRecord(kid, tenant, hash_secret(secret), spec, time.time(), None, secret[-4:])
        with self._lock:
            self._db.execute("INSERT INTO keys VALUES (?, ?, ?, ?, ?, ?, ?)",
                             (rec.id, tenant, rec.hash, spec.model_dump_json(), rec.created_at, None, rec.last4))
        return rec, f"{KEY_PREFIX}{kid}_{secret}"

    async def rotate_key(self, kid: str) -> tuple[KeyRecord, str] | None:
        """A new secret under the same id, settings and spend; the old secret stops working at once."""
        secret = secrets.token_urlsafe(32)
        with self._lock:
            cur = self._db.execute("UPDATE keys SET hash = ?, last4 = ? WHERE id = ? AND revoked_at IS NULL",
                                   (hash_secret(secret), secret[-4:], kid))
        if cur.rowcount != 1:
            return None
        rec = next(k for k in await self.keys() if k.id == kid)
        return rec, f"{KEY_PREFIX}{kid}_{secret}"

    async def revoke_key(self, kid: str) -> bool:
        with self._lock:
            cur = self._db.execute("UPDATE keys SET revoked_at = ? WHERE id = ? AND revoked_at IS NULL", (time.time(), kid))
        return cur.rowcount == 1

    @staticmethod
    def secret_matches(rec: KeyRecord, secret: str) -> bool:
        return hmac.compare_digest(rec.hash, hash_secret(secret))

    # -- usage ----------------------------------------------------------------------------------
    def record(self, rows: list[UsageRecord]) -> None:
        if not rows:
            return
        with self._lock:
            self._db.executemany(f"INSERT INTO usage ({', '.join(USAGE_FIELDS)}) VALUES "
                                 f"({', '.join('?' * len(USAGE_FIELDS))})",
                                 [tuple(getattr(r, f) for f in USAGE_FIELDS) for r in rows])

    def spent(self, column: str, value: str, since: float) -> tuple[int, float]:
        """Settled tokens and cost of one tenant or key (``column``: tenant | key_id) since ``since``:
        its requests' (instance memory-time is attributed, not held against budgets)."""
        assert column in ("tenant", "key_id")
        with self._lock:
            tokens, cost = self._db.execute(
                f"SELECT COALESCE(SUM(prompt_tokens + completion_tokens), 0), COALESCE(SUM(cost), 0) FROM usage "
                f"WHERE {column} = ? AND at >= ? AND outcome != 'instance'", (value, since)).fetchone()
        return int(tokens), float(cost)

    async def usage(self, *, tenant: str | None = None, key_id: str | None = None, unit: str | None = None,
              start: float | None = None, end: float | None = None, limit: int = 10_000) -> list[UsageRecord]:
        where, args = [], []
        for col, v in (("tenant", tenant), ("key_id", key_id), ("unit", unit)):
            if v is not None:
                where.append(f"{col} = ?")
                args.append(v)
        if start is not None:
            where.append("at >= ?")
            args.append(start)
        if end is not None:
            where.append("at < ?")
            args.append(end)
        sql = f"SELECT {', '.join(USAGE_FIELDS)} FROM usage" + (f" WHERE {' AND '.join(where)}" if where else "")
        with self._lock:
            rows = self._db.execute(sql + " ORDER BY seq LIMIT ?", (*args, limit)).fetchall()
        return [UsageRecord(*r) for r in rows]


__all__ = ["TenantStore", "KeyRecord", "UsageRecord", "split_key", "hash_secret", "KEY_PREFIX"]
