"""Tenants, keys and usage records in Redis, for several gateways sharing one set of tenants.

The directory is two hashes (``tenants``: name → spec, ``keys``: id → record with the secret's
hash) and the set ``live_keys`` the admission script checks, so a key revoked on one gateway is
refused on every other at its next admission. Each change is published on ``changes``; gateways
reload their copy of the directory when they hear one (and every ``RELOAD_S`` in case they missed
it). Usage rows go to the stream ``usage``, written in the background so a request's end never
waits on the network.
"""

from __future__ import annotations

import asyncio
import json
import logging
import secrets
import time
import uuid
from dataclasses import asdict
from typing import Awaitable, Callable

from sits.tenancy.spec import KeySpec, TenantSpec
from sits.tenancy.redis_writer import PipelinedWriter
from sits.tenancy.store import KEY_PREFIX, KeyRecord, UsageRecord, hash_secret

log = logging.getLogger("sits.tenancy")

RELOAD_S = 10.0
USAGE_MAXLEN = 10_000_000       # rows kept in the stream (approximate trim)

# KEYS: tenants, keys, live_keys; ARGV: name, revoked_at
_DELETE_TENANT = """
if redis.call('HDEL', KEYS[1], ARGV[1]) == 0 then return 0 end
local all = redis.call('HGETALL', KEYS[2])
for i = 1, #all, 2 do
  local r = cjson.decode(all[i + 1])
  if r.tenant == ARGV[1] and r.revoked_at == cjson.null then
    r.revoked_at = tonumber(ARGV[2])
    redis.call('HSET', KEYS[2], all[i], cjson.encode(r))
    redis.call('SREM', KEYS[3], all[i])
  end
end
return 1
"""

# KEYS: keys, live_keys; ARGV: id, field json (merged into the record) — only while the key is live
_UPDATE_LIVE_KEY = """
local raw = redis.call('HGET', KEYS[1], ARGV[1])
if not raw then return 0 end
local r = cjson.decode(raw)
if r.revoked_at ~= cjson.null then return 0 end
for k, v in pairs(cjson.decode(ARGV[2])) do r[k] = v end
redis.call('HSET', KEYS[1], ARGV[1], cjson.encode(r))
if r.revoked_at ~= cjson.null then redis.call('SREM', KEYS[2], ARGV[1]) end
return 1
"""

# KEYS: the usage stream; ARGV: the row's own key, the row (JSON), the stream's length bound. A batch the
# writer sends again (its answer was lost) does not add a row twice.
_ADD_USAGE = """
if redis.call('SET', ARGV[1], '1', 'NX', 'EX', 86400) then
  redis.call('XADD', KEYS[1], 'MAXLEN', '~', ARGV[3], '*', 'r', ARGV[2])
  return 1
end
return 0
"""

# KEYS: tenants; ARGV: name, spec json
_REPLACE_TENANT = """
local raw = redis.call('HGET', KEYS[1], ARGV[1])
if not raw then return 0 end
local t = cjson.decode(raw)
t.spec = ARGV[2]
redis.call('HSET', KEYS[1], ARGV[1], cjson.encode(t))
return 1
"""


def connect(url: str, max_connections: int = 64):
    """A ``redis.asyncio`` client for a gateway's tenancy: admissions beyond ``max_connections`` at
    once wait for a connection (5 s, then ``tenancy_unavailable``) rather than open more."""
    from redis.asyncio import BlockingConnectionPool, Redis
    return Redis(connection_pool=BlockingConnectionPool.from_url(url, max_connections=max_connections, timeout=5,
                                                                 decode_responses=True))


def _record_json(rec: KeyRecord) -> str:
    return json.dumps({"id": rec.id, "tenant": rec.tenant, "hash": rec.hash, "spec": rec.spec.model_dump_json(),
                       "created_at": rec.created_at, "revoked_at": rec.revoked_at, "last4": rec.last4})


def _record_of(raw: str) -> KeyRecord:
    d = json.loads(raw)
    return KeyRecord(d["id"], d["tenant"], d["hash"], KeySpec.model_validate_json(d["spec"]), d["created_at"],
                     d["revoked_at"], d["last4"])


class RedisTenantStore:
    """The same methods as ``TenantStore`` (SQLite); ``spent`` is not one of them: a shared
    ledger keeps budget spend in Redis itself."""

    def __init__(self, redis, prefix: str):
        self.redis = redis
        self.prefix = prefix
        self._tenants, self._keys = f"{prefix}tenants", f"{prefix}keys"
        self._live, self._changes, self._usage = f"{prefix}live_keys", f"{prefix}changes", f"{prefix}usage"
        self._delete_tenant = redis.register_script(_DELETE_TENANT)
        self._update_key = redis.register_script(_UPDATE_LIVE_KEY)
        self._replace_tenant = redis.register_script(_REPLACE_TENANT)
        self._add_usage = redis.register_script(_ADD_USAGE)
        self.writer = PipelinedWriter(redis, "usage rows")
        self._watcher: asyncio.Task | None = None

    async def _changed(self) -> None:
        await self.redis.publish(self._changes, "1")

    # -- tenants ----------------------------------------------------------------------------------
    async def tenants(self) -> list[tuple[TenantSpec, float]]:
        out = []
        for raw in (await self.redis.hgetall(self._tenants)).values():
            t = json.loads(raw)
            out.append((TenantSpec.model_validate_json(t["spec"]), t["created_at"]))
        return sorted(out, key=lambda p: p[0].name)

    async def put_tenant(self, spec: TenantSpec, *, create: bool) -> bool:
        if create:
            done = await self.redis.hsetnx(self._tenants, spec.name,
                                           json.dumps({"spec": spec.model_dump_json(), "created_at": time.time()}))
        else:
            done = await self._replace_tenant(keys=[self._tenants], args=[spec.name, spec.model_dump_json()])
        if done:
            await self._changed()
        return bool(done)

    async def delete_tenant(self, name: str) -> bool:
        done = await self._delete_tenant(keys=[self._tenants, self._keys, self._live], args=[name, time.time()])
        if done:
            await self._changed()
        return bool(done)

    # -- keys -------------------------------------------------------------------------------------
    async def keys(self) -> list[KeyRecord]:
        recs = [_record_of(raw) for raw in (await self.redis.hgetall(self._keys)).values()]
        return sorted(recs, key=lambda r: r.created_at)

    async def create_key(self, tenant: str, spec: KeySpec) -> tuple[KeyRecord, str]:
        kid, secret = secrets.token_hex(6), secrets.token_urlsafe(32)
        rec = KeyRecord(kid, tenant, hash_secret(secret), spec, time.time(), None, secret[-4:])
        async with self.redis.pipeline(transaction=True) as pipe:
            pipe.hset(self._keys, kid, _record_json(rec))
            pipe.sadd(self._live, kid)
            await pipe.execute()
        await self._changed()
        return rec, f"{KEY_PREFIX}{kid}_{secret}"

    async def rotate_key(self, kid: str) -> tuple[KeyRecord, str] | None:
        secret = secrets.token_urlsafe(32)
        if not await self._update_key(keys=[self._keys, self._live],
                                      args=[kid, json.dumps({"hash": hash_secret(secret), "last4": secret[-4:]})]):
            return None
        await self._changed()
        return _record_of(await self.redis.hget(self._keys, kid)), f"{KEY_PREFIX}{kid}_{secret}"

    async def revoke_key(self, kid: str) -> bool:
        done = await self._update_key(keys=[self._keys, self._live], args=[kid, json.dumps({"revoked_at": time.time()})])
        if done:
            await self._changed()
        return bool(done)

    # -- changes ----------------------------------------------------------------------------------
    async def watch(self, on_change: Callable[[], Awaitable[None]]) -> None:
        """Call ``on_change`` whenever any gateway changes the directory (and every ``RELOAD_S``)."""
        async def loop() -> None:
            while True:
                pubsub = self.redis.pubsub()
                try:
                    await pubsub.subscribe(self._changes)
                    await on_change()          # whatever changed while not subscribed
                    while True:
                        msg = await pubsub.get_message(ignore_subscribe_messages=True, timeout=RELOAD_S)
                        await on_change()
                        if msg is None:
                            continue
                except asyncio.CancelledError:
                    raise
                except Exception as e:
                    log.warning("tenant directory watch lost (%s); reconnecting", e)
                    await asyncio.sleep(1.0)
                finally:
                    try:
                        await pubsub.aclose()
                    except Exception:   # noqa: BLE001 - a closed connection closes anyway
                        pass
        self._watcher = asyncio.get_running_loop().create_task(loop(), name="sits-tenant-watch")

    # -- usage ------------------------------------------------------------------------------------
    def record(self, rows: list[UsageRecord]) -> None:
        """Written in the background, in order (the request has ended; its ledger settles apart)."""
        for r in rows:
            args = [f"{self.prefix}urow:{uuid.uuid4().hex}", json.dumps(asdict(r)), USAGE_MAXLEN]
            self.writer.put(lambda pipe, args=args: self._add_usage(keys=[self._usage], args=args, client=pipe))

    async def flush(self, timeout_s: float = 2.0) -> None:
        """This gateway's rows written (or ``timeout_s`` passed: Redis is not taking them now)."""
        try:
            await asyncio.wait_for(self.writer.drain(), timeout_s)
        except asyncio.TimeoutError:
            pass

    async def usage(self, *, tenant: str | None = None, key_id: str | None = None, unit: str | None = None,
                    start: float | None = None, end: float | None = None, limit: int = 10_000) -> list[UsageRecord]:
        await self.flush()
        # stream ids are the write time in ms: a row is written a moment after its ``at``
        lo = "-" if start is None else str(max(int(start * 1000) - 60_000, 0))
        out: list[UsageRecord] = []
        cursor = lo
        while len(out) < limit:
            batch = await self.redis.xrange(self._usage, min=cursor, max="+", count=1000)
            if not batch:
                break
            for sid, fields in batch:
                r = UsageRecord(**json.loads(fields["r"]))
                if end is not None and r.at >= end + 60:
                    return out
                if ((tenant is None or r.tenant == tenant) and (key_id is None or r.key_id == key_id)
                        and (unit is None or r.unit == unit) and (start is None or r.at >= start)
                        and (end is None or r.at < end)):
                    out.append(r)
                    if len(out) >= limit:
                        break
            cursor = "(" + batch[-1][0]
        return out

    async def aclose(self) -> None:
        if self._watcher is not None:
            self._watcher.cancel()
            await asyncio.gather(self._watcher, return_exceptions=True)
        await self.writer.aclose()


__all__ = ["RedisTenantStore"]
