"""The accounts' running state in Redis, shared by every gateway that names the same Redis.

Admission is one Lua script: it checks every account of the request (requests in flight and
queued, the per-minute buckets refilled to Redis's own clock, every budget of the period) and, only
if all admit, reserves on all of them and records the reservation under this gateway's id. Redis
runs a script alone, so no interleaving of gateways or requests can overspend a budget, and no
counter is "synced" later: there is only the one. Settlement is another script (the reservation is
read back from Redis, so what is released is exactly what was taken).

A gateway that dies leaves reservations behind; each gateway refreshes a heartbeat key, and any
gateway releases the reservations of one whose heartbeat expired (their requests died with it).
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid

from sits.engine.errors import SitsError
from sits.tenancy.accounts import (budget_refusal, budget_view, concurrency_refusal, period_end, period_start,
                                   queue_refusal, rate_headers, rpm_refusal, tpm_refusal)
from sits.tenancy.ledger import AccountRef, Reservation
from sits.tenancy.redis_writer import PipelinedWriter
from sits.tenancy.spec import BudgetSpec, LimitsSpec

log = logging.getLogger("sits.tenancy")

HEARTBEAT_S = 10.0
DEAD_AFTER_S = 30                       # a gateway whose heartbeat is this old is gone
BUDGET_KEPT_S = 35 * 86400              # a period's spend stays readable this long after it ends


class KeyRevokedError(SitsError):
    """Authenticated against this gateway's copy of the keys, refused by the shared store's."""

    code = "invalid_api_key"
    http_status = 401


class TenancyUnavailableError(SitsError):
    """The shared tenant store cannot be reached: nothing is admitted unaccounted."""

    code = "tenancy_unavailable"
    http_status = 503
    retry_after_s = 1


_BUCKET = """
local function bucket(h, name, cap, now)
  if not cap then return nil end
  local v = redis.call('HMGET', h, name, name .. '_t', name .. '_cap')
  if not v[1] or tonumber(v[3]) ~= cap then return cap end
  return math.min(cap, tonumber(v[1]) + math.max(now - tonumber(v[2]), 0) * cap / 60)
end
local function clock()
  local t = redis.call('TIME')
  return tonumber(t[1]) + tonumber(t[2]) / 1000000
end
"""

# ARGV[1]: {rid, resv, live, tenants, key_id, tenant, tokens, cost, dry, accounts: [{key, max_concurrent,
# max_queued, rpm, tpm, budgets: [{key, tokens, cost, expire_at}]}]} (absent fields: no limit)
ADMIT = _BUCKET + """
local req = cjson.decode(ARGV[1])
local now = clock()
if redis.call('EXISTS', req.gone) == 1 then return {'gone'} end
if req.key_id and redis.call('SISMEMBER', req.live, req.key_id) == 0 then return {'revoked'} end
if redis.call('HEXISTS', req.tenants, req.tenant) == 0 then return {'revoked'} end
local tokens, cost = req.tokens, req.cost
local rpms, tpms = {}, {}
for i, a in ipairs(req.accounts) do
  local c = redis.call('HMGET', a.key, 'active', 'queued')
  local active, queued = tonumber(c[1]) or 0, tonumber(c[2]) or 0
  if a.max_concurrent and active >= a.max_concurrent then return {'concurrency', i, active} end
  if a.max_queued and queued >= a.max_queued then return {'queued', i, queued} end
  local rpm, tpm = bucket(a.key, 'rpm', a.rpm, now), bucket(a.key, 'tpm', a.tpm, now)
  if rpm and rpm < 1 then return {'rpm', i, tostring((1 - rpm) * 60 / a.rpm)} end
  if tpm then
    if tokens > a.tpm then return {'tpm', i, '-1'} end
    if tpm < tokens then return {'tpm', i, tostring((tokens - tpm) * 60 / a.tpm)} end
  end
  for j, b in ipairs(a.budgets) do
    local s = redis.call('HMGET', b.key, 'st', 'sc', 'rt', 'rc')
    local st, sc, rt, rc = tonumber(s[1]) or 0, tonumber(s[2]) or 0, tonumber(s[3]) or 0, tonumber(s[4]) or 0
    if (b.tokens and st + rt + tokens > b.tokens) or (b.cost and sc + rc + cost > b.cost + 1e-12) then
      return {'budget', i, j, tostring(st), tostring(sc), tostring(rt), tostring(rc)}
    end
  end
  rpms[i], tpms[i] = rpm or -1, tpm or -1
end
if req.dry then return {'ok'} end
local out = {'ok'}
for i, a in ipairs(req.accounts) do
  redis.call('HINCRBY', a.key, 'active', 1)
  redis.call('HINCRBY', a.key, 'queued', 1)
  if a.rpm then redis.call('HSET', a.key, 'rpm', tostring(rpms[i] - 1), 'rpm_t', tostring(now), 'rpm_cap', a.rpm) end
  if a.tpm then redis.call('HSET', a.key, 'tpm', tostring(tpms[i] - tokens), 'tpm_t', tostring(now), 'tpm_cap', a.tpm) end
  for _, b in ipairs(a.budgets) do
    redis.call('HINCRBY', b.key, 'rt', tokens)
    redis.call('HINCRBYFLOAT', b.key, 'rc', tostring(cost))
    if b.expire_at then redis.call('EXPIREAT', b.key, b.expire_at) end
  end
  out[#out + 1] = tostring(rpms[i] - 1)
  out[#out + 1] = tostring(tpms[i] - tokens)
end
redis.call('HSET', req.resv, req.rid, cjson.encode({accounts = req.accounts, tokens = tokens, cost = cost, started = 0}))
return out
"""

# KEYS[1]: a gateway's reservations; ARGV: rid (or '*': all of them, a dead gateway's), tokens, cost, the
# rid's "gone" marker, its budget keys (JSON). A reservation that is not there (released by a reaper, or an
# admission whose answer never arrived) is still charged what was used, and marked gone so that an admission
# still on its way is refused instead of reserving for a request nobody will settle.
SETTLE = _BUCKET + """
local now = clock()
local function settle(rid, raw, tokens, cost)
  local r = cjson.decode(raw)
  for _, a in ipairs(r.accounts) do
    redis.call('HINCRBY', a.key, 'active', -1)
    if r.started == 0 then redis.call('HINCRBY', a.key, 'queued', -1) end
    if a.tpm and tonumber(redis.call('HGET', a.key, 'tpm_cap')) == a.tpm then   -- not after a capacity change
      local lv = bucket(a.key, 'tpm', a.tpm, now)
      lv = math.min(a.tpm, lv + math.max(r.tokens - tokens, 0))
      redis.call('HSET', a.key, 'tpm', tostring(lv), 'tpm_t', tostring(now))
    end
    for _, b in ipairs(a.budgets) do
      redis.call('HINCRBY', b.key, 'rt', -r.tokens)
      redis.call('HINCRBYFLOAT', b.key, 'rc', tostring(-r.cost))
      if tokens ~= 0 then redis.call('HINCRBY', b.key, 'st', tokens) end
      if cost ~= 0 then redis.call('HINCRBYFLOAT', b.key, 'sc', tostring(cost)) end
    end
  end
  redis.call('HDEL', KEYS[1], rid)
end
if ARGV[1] == '*' then
  local all = redis.call('HGETALL', KEYS[1])
  for i = 1, #all, 2 do settle(all[i], all[i + 1], 0, 0) end
  return #all / 2
end
local tokens, cost = tonumber(ARGV[2]), tonumber(ARGV[3])
local raw = redis.call('HGET', KEYS[1], ARGV[1])
if raw then
  settle(ARGV[1], raw, tokens, cost)
  return 1
end
redis.call('SET', ARGV[4], '1', 'EX', 600)
for _, key in ipairs(cjson.decode(ARGV[5])) do
  if tokens ~= 0 then redis.call('HINCRBY', key, 'st', tokens) end
  if cost ~= 0 then redis.call('HINCRBYFLOAT', key, 'sc', tostring(cost)) end
end
return 0
"""

# KEYS[1]: a gateway's reservations; ARGV[1]: rid
FIRST_TOKEN = """
local raw = redis.call('HGET', KEYS[1], ARGV[1])
if not raw then return 0 end
local r = cjson.decode(raw)
if r.started == 1 then return 0 end
r.started = 1
for _, a in ipairs(r.accounts) do redis.call('HINCRBY', a.key, 'queued', -1) end
redis.call('HSET', KEYS[1], ARGV[1], cjson.encode(r))
return 1
"""


class RedisLedger:
    def __init__(self, redis, prefix: str, clock=time.time):
        """``redis``: a ``redis.asyncio`` client (decoded responses), shared with the tenant store."""
        self.redis = redis
        self.prefix = prefix
        self.clock = clock
        self.gateway_id = uuid.uuid4().hex[:12]
        self.specs: dict[AccountRef, tuple[LimitsSpec, list[BudgetSpec]]] = {}
        self._admit = redis.register_script(ADMIT)
        self._settle = redis.register_script(SETTLE)
        self._first = redis.register_script(FIRST_TOKEN)
        self.writer = PipelinedWriter(redis, "settlements")      # first tokens and settlements, in order
        self._views: dict[AccountRef, tuple[int, list[dict]]] = {}
        self._maintainers: list[asyncio.Task] = []
        self._beat_client = None
        self._beats = 0

    # -- names ------------------------------------------------------------------------------------
    @property
    def _resv(self) -> str:
        return f"{self.prefix}resv:{self.gateway_id}"

    def _gone(self, rid: str) -> str:
        return f"{self.prefix}gone:{rid}"

    def _acct_key(self, ref: AccountRef) -> str:
        return f"{self.prefix}acct:{ref[0]}:{ref[1]}"

    def _budget_keys(self, ref: AccountRef, budgets: list[BudgetSpec], now: float) -> list[tuple[BudgetSpec, str, float]]:
        """One Redis hash per budget and period; two budgets of one period are told apart by their order."""
        seen: dict[str, int] = {}
        out = []
        for b in budgets:
            n = seen[b.period] = seen.get(b.period, -1) + 1
            start = period_start(b.period, now)
            out.append((b, f"{self.prefix}budget:{ref[0]}:{ref[1]}:{b.period}.{n}:{int(start)}", start))
        return out

    # -- the directory tells us the limits --------------------------------------------------------
    def configure(self, ref: AccountRef, limits: LimitsSpec, budgets: list[BudgetSpec]) -> None:
        self.specs[ref] = (limits, list(budgets))

    def drop(self, ref: AccountRef) -> None:
        self.specs.pop(ref, None)
        self._views.pop(ref, None)

    def refs(self) -> set[AccountRef]:
        return set(self.specs)

    # -- admission --------------------------------------------------------------------------------
    def _request(self, refs: list[AccountRef], tokens: int, cost: float, dry: bool) -> tuple[dict, list]:
        now = self.clock()
        accounts, used = [], []
        for ref in refs:
            spec = self.specs.get(ref)
            if spec is None:
                continue
            limits, budgets = spec
            acct = {"key": self._acct_key(ref), "budgets": []}
            for name, v in (("max_concurrent", limits.max_concurrent), ("max_queued", limits.max_queued),
                            ("rpm", limits.requests_per_min), ("tpm", limits.tokens_per_min)):
                if v is not None:
                    acct[name] = v
            for b, key, start in self._budget_keys(ref, budgets, now):
                entry = {"key": key}
                if b.tokens is not None:
                    entry["tokens"] = b.tokens
                if b.cost is not None:
                    entry["cost"] = b.cost
                end = period_end(b.period, now)
                if end is not None:
                    entry["expire_at"] = int(end) + BUDGET_KEPT_S
                acct["budgets"].append(entry)
            accounts.append(acct)
            used.append((ref, limits, budgets))
        rid = uuid.uuid4().hex
        req = {"rid": rid, "gone": self._gone(rid), "resv": self._resv, "live": f"{self.prefix}live_keys",
               "tenants": f"{self.prefix}tenants", "tokens": tokens, "cost": cost, "accounts": accounts}
        key_id = next((r[1] for r in refs if r[0] == "key"), None)
        if key_id is not None:
            req["key_id"] = key_id
        req["tenant"] = next(r[1] for r in refs if r[0] == "tenant")
        if dry:
            req["dry"] = True
        return req, used

    async def _run_admit(self, refs: list[AccountRef], tokens: int, cost: float, dry: bool) -> tuple[dict, list, list]:
        req, used = self._request(refs, tokens, cost, dry)
        return req, used, await self._run_admit_request(req, used, tokens, cost)

    async def _run_admit_request(self, req: dict, used: list, tokens: int, cost: float) -> list:
        """Run the admission script for ``req``; its answer, or the typed refusal."""
        dry = bool(req.get("dry"))
        keys = [req["resv"], req["live"], req["tenants"], *(a["key"] for a in req["accounts"]),
                *(b["key"] for a in req["accounts"] for b in a["budgets"])]
        try:
            out = await self._admit(keys=keys, args=[json.dumps(req)])
        except BaseException as e:
            # cancelled (the client left) or no answer (a timeout): Redis may have run the script all the
            # same. Release whatever it reserved; the marker refuses the script if it has yet to run.
            if not dry:
                self._release(req["rid"], _budget_keys_of(req))
            if not isinstance(e, Exception):
                raise
            raise TenancyUnavailableError(f"the shared tenant store cannot be reached ({type(e).__name__}: {e}); "
                                          f"retry shortly") from None
        if out[0] != "ok":
            raise self._refusal(out, req, used, tokens, cost)
        return out

    def _refusal(self, out: list, req: dict, used: list, tokens: int, cost: float) -> SitsError:
        """The typed error of what the script refused, worded as the in-process ledger words it."""
        if out[0] == "gone":
            return TenancyUnavailableError("the admission timed out on its way to the shared tenant store; retry")
        if out[0] == "revoked":
            return KeyRevokedError("this API key was revoked (or its tenant deleted) a moment ago")
        ref, limits, budgets = used[int(out[1]) - 1]
        who = f"{ref[0]} {ref[1]!r}"
        now = self.clock()
        kind = out[0]
        if kind == "concurrency":
            err = concurrency_refusal(who, int(out[2]), limits.max_concurrent)
        elif kind == "queued":
            err = queue_refusal(who, int(out[2]), limits.max_queued)
        elif kind == "rpm":
            err = rpm_refusal(who, limits.requests_per_min, float(out[2]))
        elif kind == "tpm":
            wait = float(out[2])
            err = tpm_refusal(who, limits.tokens_per_min, tokens, None if wait < 0 else wait)
        else:
            b, _, start = self._budget_keys(ref, budgets, now)[int(out[2]) - 1]
            st, sc, rt, rc = (float(x) for x in out[3:7])
            err = budget_refusal(who, budget_view(b, start, int(st), sc, int(rt), rc), tokens, cost, now)
        err.headers = {}
        return err

    async def check(self, refs: list[AccountRef], tokens: int, cost: float) -> None:
        await self._run_admit(refs, tokens, cost, dry=True)

    async def admit(self, refs: list[AccountRef], tokens: int, cost: float) -> Reservation:
        req, used, out = await self._run_admit(refs, tokens, cost, dry=False)
        headers: dict[str, str] = {}
        for i, (ref, limits, _) in enumerate(used):
            rpm, tpm = float(out[1 + 2 * i]), float(out[2 + 2 * i])
            h = rate_headers(_bucket_state(limits.requests_per_min, rpm), _bucket_state(limits.tokens_per_min, tpm))
            if h:
                headers = h
                break
        return Reservation(refs, tokens, cost, headers, handle=(req["rid"], _budget_keys_of(req)))

    def first_token(self, res: Reservation) -> None:
        self.writer.put(lambda pipe, rid=res.handle[0]: self._first(keys=[self._resv], args=[rid], client=pipe))

    def settle(self, res: Reservation, tokens: int, cost: float) -> None:
        rid, budget_keys = res.handle
        self._release(rid, budget_keys, tokens, cost)

    def _release(self, rid: str, budget_keys: list[str], tokens: int = 0, cost: float = 0.0) -> None:
        args = [rid, tokens, repr(float(cost)), self._gone(rid), json.dumps(budget_keys)]
        self.writer.put(lambda pipe: self._settle(keys=[self._resv], args=args, client=pipe))

    async def drain(self) -> None:
        await self.writer.drain()

    # -- views ------------------------------------------------------------------------------------
    async def view(self, ref: AccountRef) -> dict | None:
        spec = self.specs.get(ref)
        if spec is None:
            return None
        limits, budgets = spec
        now = self.clock()
        keys = self._budget_keys(ref, budgets, now)
        async with self.redis.pipeline(transaction=False) as pipe:
            pipe.hgetall(self._acct_key(ref))
            for _, key, _ in keys:
                pipe.hmget(key, "st", "sc", "rt", "rc")
            acct, *states = await pipe.execute()
        views = []
        for (b, _, start), s in zip(keys, states):
            st, sc, rt, rc = (float(x) if x is not None else 0.0 for x in s)
            views.append(budget_view(b, start, int(st), sc, int(rt), max(rc, 0.0) if abs(rc) > 1e-9 else 0.0))
        active = int(acct.get("active", 0))
        self._views[ref] = (active, views)
        out = {"limits": limits.model_dump(exclude_none=True), "active": active, "queued": int(acct.get("queued", 0)),
               "budgets": views}
        rate = rate_headers(_stored_bucket(acct, "rpm", limits.requests_per_min, now),
                            _stored_bucket(acct, "tpm", limits.tokens_per_min, now))
        if rate:
            out["rate"] = rate
        return out

    def snapshot(self) -> list[tuple[AccountRef, int, list[dict]]]:
        return [(ref, active, views) for ref, (active, views) in list(self._views.items()) if ref in self.specs]

    # -- upkeep -----------------------------------------------------------------------------------
    async def start(self) -> None:
        from redis.asyncio import ConnectionPool, Redis
        pool = self.redis.connection_pool           # the heartbeat never waits behind admissions for a connection
        self._beat_client = Redis(connection_pool=ConnectionPool(connection_class=pool.connection_class,
                                                                 max_connections=2, **pool.connection_kwargs))
        await self._beat()
        loop = asyncio.get_running_loop()
        self._maintainers = [loop.create_task(self._every(HEARTBEAT_S, self._beat)),
                             loop.create_task(self._every(HEARTBEAT_S, self._upkeep))]

    async def _beat(self) -> None:
        client = self._beat_client or self.redis
        lapsed = await client.set(f"{self.prefix}gw:{self.gateway_id}", "1", ex=DEAD_AFTER_S, get=True) is None
        await client.sadd(f"{self.prefix}gateways", self.gateway_id)
        if lapsed and self._beats:
            log.error("this gateway's heartbeat lapsed (Redis unreachable for %d s?): another gateway may have "
                      "released its reservations; what its requests use is still charged when they end", DEAD_AFTER_S)
        self._beats += 1

    async def reap(self) -> int:
        """Release the reservations of gateways whose heartbeat expired; how many were released."""
        released = 0
        for gid in await self.redis.smembers(f"{self.prefix}gateways"):
            if gid == self.gateway_id or await self.redis.exists(f"{self.prefix}gw:{gid}"):
                continue
            n = await self._settle(keys=[f"{self.prefix}resv:{gid}"], args=["*", 0, 0, "", "[]"])
            await self.redis.srem(f"{self.prefix}gateways", gid)
            if n:
                log.warning("released %d reservations of gateway %s (its heartbeat stopped)", n, gid)
            released += int(n)
        return released

    async def _upkeep(self) -> None:
        await self.reap()
        for ref in [r for r in self.specs if r[0] == "tenant"]:
            await self.view(ref)          # the metrics' budgets and in-flight gauges

    async def _every(self, interval_s: float, work) -> None:
        while True:
            await asyncio.sleep(interval_s)
            try:
                await work()
            except asyncio.CancelledError:
                raise
            except Exception as e:
                log.warning("tenant ledger %s failed (%s: %s); retried in %g s", work.__name__.strip("_"),
                            type(e).__name__, e, interval_s)

    async def aclose(self) -> None:
        for task in self._maintainers:
            task.cancel()
        await asyncio.gather(*self._maintainers, return_exceptions=True)
        await self.writer.aclose()
        try:
            # what is still reserved here belongs to requests that end with this process: released now
            # (not left for a reaper, which only looks for gateways that are still registered)
            n = await self._settle(keys=[self._resv], args=["*", 0, 0, "", "[]"])
            if n:
                log.warning("released %d reservations left at shutdown", n)
            await self.redis.delete(f"{self.prefix}gw:{self.gateway_id}")
            await self.redis.srem(f"{self.prefix}gateways", self.gateway_id)
        except Exception:
            log.warning("could not deregister gateway %s from the tenant store; its reservations are released "
                        "once its heartbeat expires", self.gateway_id)
        if self._beat_client is not None:
            await self._beat_client.aclose(close_connection_pool=True)


def _budget_keys_of(req: dict) -> list[str]:
    return [b["key"] for a in req["accounts"] for b in a["budgets"]]


def _bucket_state(capacity: int | None, level: float) -> tuple[float, int, float] | None:
    if capacity is None:
        return None
    return float(capacity), int(level), (capacity - level) * 60.0 / capacity


def _stored_bucket(acct: dict, name: str, capacity: int | None, now: float) -> tuple[float, int, float] | None:
    if capacity is None:
        return None
    if name not in acct or float(acct.get(f"{name}_cap", -1)) != capacity:
        return _bucket_state(capacity, float(capacity))
    level = min(capacity, float(acct[name]) + max(now - float(acct[f"{name}_t"]), 0.0) * capacity / 60.0)
    return _bucket_state(capacity, level)
