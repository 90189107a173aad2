"""``sits bench tenancy``: what admitting and settling a request costs with each ledger.

A request with a tenant's key is admitted (its worst case reserved on its key's and its tenant's
accounts: limits, rate buckets, a budget) and settled when it ends. ``LocalLedger`` does that in the
gateway's memory; ``RedisLedger`` in one Lua script per admission and one per settlement, so that
several gateways can share the accounts. Measured on one event loop: the latency of one admission,
and the admissions per second of 64 concurrent requests spread over 1 and over 2 gateways (each its
own Redis client) sharing one tenant. The baseline is the local ledger; the ledgers alternate in
each round. The Redis is a ``redis-server`` this benchmark starts on loopback, or ``--redis URL``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import shutil
import statistics
import subprocess
import tempfile
import time

from sits.bench.common import add_bench_command, free_port, grouped_bars, log, pct, publish, wait_until

DOC_BEGIN = "<!-- sits bench tenancy: begin -->"
DOC_END = "<!-- sits bench tenancy: end -->"
PREFIX = "sits-bench:{tenancy}:"


def _accounts():
    from sits.tenancy.spec import BudgetSpec, LimitsSpec
    key = (LimitsSpec(requests_per_min=10**9, tokens_per_min=10**12, max_concurrent=10**6), [])
    tenant = (LimitsSpec(max_concurrent=10**6), [BudgetSpec(period="day", tokens=10**15)])
    return [(("key", "benchkey0001"), key), (("tenant", "bench"), tenant)]


async def _ledgers(kind: str, url: str | None, gateways: int):
    """``gateways`` ledgers sharing one set of accounts, and how to close them."""
    from sits.tenancy.ledger import LocalLedger
    if kind == "local":
        ledger = LocalLedger(lambda column, ident, since: (0, 0.0))
        for ref, (limits, budgets) in _accounts():
            ledger.configure(ref, limits, budgets)
        return [ledger], (lambda: asyncio.sleep(0))
    from sits.tenancy.redis_ledger import RedisLedger
    from sits.tenancy.redis_store import connect
    clients = [connect(url) for _ in range(gateways)]
    await clients[0].hset(f"{PREFIX}tenants", "bench", "{}")
    await clients[0].sadd(f"{PREFIX}live_keys", "benchkey0001")
    ledgers = [RedisLedger(c, PREFIX) for c in clients]
    for ledger in ledgers:
        for ref, (limits, budgets) in _accounts():
            ledger.configure(ref, limits, budgets)
        await ledger.start()

    async def close() -> None:
        for ledger in ledgers:
            await ledger.aclose()
        for c in clients:
            await c.aclose(close_connection_pool=True)
    return ledgers, close


async def _one(ledger) -> None:
    refs = [("key", "benchkey0001"), ("tenant", "bench")]
    res = await ledger.admit(refs, 64, 0.0)
    ledger.first_token(res)
    ledger.settle(res, 40, 0.0)


async def _latency(kind: str, url: str | None, n: int) -> list[float]:
    ledgers, close = await _ledgers(kind, url, 1)
    ledger = ledgers[0]
    try:
        for _ in range(20):
            await _one(ledger)
        out = []
        for _ in range(n):
            t0 = time.perf_counter()
            await _one(ledger)
            out.append((time.perf_counter() - t0) * 1e6)
        await ledger.drain()
        return out
    finally:
        await close()


async def _throughput(kind: str, url: str | None, gateways: int, n: int, concurrency: int = 64) -> float:
    ledgers, close = await _ledgers(kind, url, gateways)
    try:
        left = [n]

        async def worker(i: int) -> None:
            ledger = ledgers[i % len(ledgers)]
            while left[0] > 0:
                left[0] -= 1
                await _one(ledger)

        t0 = time.perf_counter()
        await asyncio.gather(*(worker(i) for i in range(concurrency)))
        for ledger in ledgers:
            await ledger.drain()
        return n / (time.perf_counter() - t0)
    finally:
        await close()


def _start_redis() -> tuple[subprocess.Popen, str]:
    exe = shutil.which("redis-server")
    if exe is None:
        raise SystemExit("sits bench tenancy needs redis-server (apt-get install redis-server) or --redis URL")
    port = free_port()
    proc = subprocess.Popen([exe, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
                             "--dir", tempfile.mkdtemp(prefix="sits-bench-redis-")],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    import redis
    wait_until(lambda: _pings(redis, port), 20, "redis-server to start")
    return proc, f"redis://127.0.0.1:{port}/0"


def _pings(redis, port: int) -> bool:
    try:
        return bool(redis.Redis(port=port).ping())
    except redis.ConnectionError:
        return False


def run_tenancy_bench(*, rounds: int = 5, n: int = 2000, url: str | None = None, json_out: str | None = None,
                      docs_out: str | None = None) -> dict:
    proc = None
    if url is None:
        proc, url = _start_redis()
    cases = {"local": ("local", 1), "redis": ("redis", 1), "redis, 2 gateways": ("redis", 2)}
    lat: dict[str, list[list[float]]] = {"local": [], "redis": []}
    thr: dict[str, list[float]] = {c: [] for c in cases}
    try:
        for r in range(rounds):
            order = list(cases) if r % 2 == 0 else list(reversed(cases))
            for case in order:
                kind, gateways = cases[case]
                if gateways == 1:
                    lat[kind].append(asyncio.run(_latency(kind, url, n)))
                thr[case].append(asyncio.run(_throughput(kind, url, gateways, n)))
            log(f"round {r + 1}/{rounds}: " + ", ".join(f"{c} {thr[c][-1]:,.0f}/s" for c in cases))
    finally:
        if proc is not None:
            proc.terminate()
            proc.wait(10)
    latency = {k: {"p50_us": statistics.median(pct(x, 0.5) for x in v), "p99_us": statistics.median(pct(x, 0.99) for x in v)}
               for k, v in lat.items()}
    result = {"rounds": rounds, "requests": n, "latency": latency,
              "admissions_per_s": {c: statistics.median(v) for c, v in thr.items()}}
    return publish(result, "tenancy", _markdown, DOC_BEGIN, DOC_END, json_out, docs_out, plot=_plot)


def _plot(r: dict, path) -> None:
    cases = list(r["admissions_per_s"])
    grouped_bars(path, cases, {"admissions/s (64 concurrent)": [r["admissions_per_s"][c] for c in cases]},
                 ylabel="admit + settle per second", title="Tenant admission: in-process vs Redis ledger",
                 log_scale=True)


def _markdown(r: dict, command: str, plot: str) -> str:
    lat, thr = r["latency"], r["admissions_per_s"]
    lines = [DOC_BEGIN, "## Tenant admission: in-process vs Redis ledger (`sits bench tenancy`)", "",
             f"Command: `{command}`  ",
             f"Admit (key + tenant: limits, rate buckets, a day budget) + first token + settle of one request, "
             f"{r['requests']} requests per case, medians of {r['rounds']} rounds with the cases taking turns; "
             "Redis on loopback, one event loop. Baseline: the in-process ledger (one gateway).", "",
             "| ledger | admit latency p50 µs | p99 µs | admissions/s, 64 concurrent | vs local |",
             "|---|---|---|---|---|"]
    for case, per_s in thr.items():
        kind = "redis" if case.startswith("redis") else "local"
        p50, p99 = (f"{lat[kind]['p50_us']:.0f}", f"{lat[kind]['p99_us']:.0f}") if case in lat else ("", "")
        lines.append(f"| {case} | {p50} | {p99} | {per_s:,.0f} | {per_s / thr['local']:.3f}× |")
    lines += ["", f"A shared ledger adds one round trip to Redis to each request's time to first token (p50 "
              f"{lat['redis']['p50_us'] / 1e3:.2f} ms here) and bounds what one gateway admits per second; gateways "
              "sharing a tenant stay exact (the race test), as one gateway with the in-process ledger is.", "",
              f"![admissions per second]({plot})", "", DOC_END]
    return "\n".join(lines)


def _cli(args: argparse.Namespace) -> int:
    r = run_tenancy_bench(rounds=args.repeats, n=args.requests, url=args.redis, json_out=args.json,
                          docs_out=args.write_docs)
    print(json.dumps({"latency": r["latency"], "admissions_per_s": r["admissions_per_s"]}, indent=2))
    return 0


def register_cli(subparsers: argparse._SubParsersAction) -> None:
    p = add_bench_command(subparsers, "tenancy", "tenant admission cost: in-process ledger vs Redis (shared)",
                          _cli, model=False, repeats="rounds of every case, median reported", repeats_default=5)
    p.add_argument("--requests", type=int, default=2000, help="requests admitted and settled per case and round")
    p.add_argument("--redis", default=None, help="redis://HOST:PORT/DB to use (default: start a redis-server)")
