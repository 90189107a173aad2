"""``sits bench mesh``: SLA attainment with a mesh in front of a faulty large tier, against calling
the large tier directly, in the same run.

Two servers: a ``sits serve`` of the model plays the large tier (reached by the gateway as a remote
unit, ``large``), and a ``sits up`` gateway holds a local unit of the same model (``small``) and a
mesh ``assist`` with tiers ``[large, small]``. A fault on ``large`` (in the gateway: a first-frame
block on a share of its requests) stands for a large tier in trouble. The same streamed chat
requests go to ``large`` directly and to ``assist``, the two phases taking turns each round. A
request attains the SLA when its first token reached the client within the SLO (an error does
not attain it). Reported per phase: attainment, TTFT p50/p95 at the client, errors, and which tier
of the mesh served each request (with its escalations and skips, from the mesh's own counters).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import tempfile
import time
from pathlib import Path

from sits.bench.common import add_bench_command, grouped_bars, log, pct, publish, start_sits, stop_sits

DOC_BEGIN = "<!-- sits bench mesh: begin -->"
DOC_END = "<!-- sits bench mesh: end -->"
_WORDS = "river light house music window garden story paper market winter engine mountain letter".split()


def _config(model: str, upstream: str, served: str, slo_ms: float, budget_ms: float, block_ms: float,
            share: float) -> str:
    return json.dumps({"units": [
        {"name": "small", "model": model, "slo": {"ttft_ms": slo_ms},
         "scale": {"min_instances": 1, "max_instances": 1, "keep_alive_s": 3600},
         "resources": {"device": "cpu", "threads": 1, "warmup": "minimal"}},
        {"name": "large", "backend": {"openai": upstream + "/v1", "model": served}, "slo": {"ttft_ms": slo_ms},
         "faults": {"seed": 7, "inject": [{"kind": "first_frame_block", "block_ms": block_ms, "probability": share}]}},
        {"name": "assist", "mesh": {"tiers": ["large", "small"], "ttft_budget_ms": budget_ms},
         "slo": {"ttft_ms": slo_ms}},
    ]})


async def _one(client, url: str, model: str, prompt: str, max_tokens: int) -> tuple[float | None, str | None]:
    """(client TTFT in s, or None; the error code, or None) of one streamed chat request."""
    body = {"model": model, "messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens,
            "temperature": 0, "stream": True}
    t0 = time.perf_counter()
    ttft = None
    try:
        async with client.stream("POST", url + "/v1/chat/completions", json=body) as r:
            if r.status_code != 200:
                err = json.loads(await r.aread()).get("error", {})
                return None, str(err.get("code") or r.status_code)
            async for line in r.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    return ttft, str(chunk["error"].get("code"))
                if ttft is None and any((c.get("delta") or {}).get("content") for c in chunk.get("choices", [])):
                    ttft = time.perf_counter() - t0
    except Exception as e:  # noqa: BLE001 - a broken request is a miss, named by its type
        return None, type(e).__name__
    return ttft, None


async def _phase(url: str, model: str, prompts: list[str], concurrency: int, max_tokens: int) -> list[tuple]:
    import httpx
    out: list[tuple] = []
    queue = list(prompts)
    async with httpx.AsyncClient(timeout=120) as client:
        async def worker() -> None:
            while queue:
                out.append(await _one(client, url, model, queue.pop(), max_tokens))
        await asyncio.gather(*(worker() for _ in range(concurrency)))
    return out


def _mesh_view(url: str) -> dict:
    import httpx
    return httpx.get(url + "/v1/units/assist", timeout=10).json()


def run_mesh_bench(model: str, *, rounds: int = 3, requests: int = 40, concurrency: int = 2, max_tokens: int = 16,
                   slo_ms: float = 1000.0, budget_ms: float = 600.0, block_ms: float = 2500.0, share: float = 0.5,
                   json_out: str | None = None, docs_out: str | None = None) -> dict:
    served = Path(model).name
    up, up_url = start_sits(["serve", "--model", model, "--threads", "1", "--served-model-name", served])
    gw = None
    try:
        data = tempfile.mkdtemp(prefix="sits-bench-mesh-")
        cfg = Path(data) / "mesh.yaml"
        cfg.write_text(_config(str(Path(model).resolve()), up_url, served, slo_ms, budget_ms, block_ms, share))
        gw, gw_url = start_sits(["up", "--config", str(cfg), "--data-dir", data])
        import httpx
        from sits.bench.common import wait_until
        wait_until(lambda: any(i["state"] == "READY" for i in httpx.get(gw_url + "/v1/units/small").json()["instances"]),
                   300, "the small tier's instance")
        rng = random.Random(0)
        phases = {"large directly": "large", "mesh [large, small]": "assist"}
        results: dict[str, list[tuple]] = {p: [] for p in phases}
        served_by: dict[str, int] = {}
        for r in range(rounds):
            for phase in (list(phases) if r % 2 == 0 else list(reversed(phases))):
                prompts = [" ".join(rng.choice(_WORDS) for _ in range(rng.randint(4, 24))) for _ in range(requests)]
                before = _mesh_view(gw_url)
                results[phase] += asyncio.run(_phase(gw_url, phases[phase], prompts, concurrency, max_tokens))
                if phases[phase] == "assist":
                    after = _mesh_view(gw_url)
                    b = {t["unit"]: t["served"] for t in before["tiers"]}
                    for t in after["tiers"]:
                        served_by[t["unit"]] = served_by.get(t["unit"], 0) + t["served"] - b[t["unit"]]
                got = results[phase][-requests:]
                log(f"round {r + 1}/{rounds} {phase}: attained "
                    f"{sum(1 for t, e in got if e is None and t is not None and t * 1e3 <= slo_ms)}/{requests}")
        final = _mesh_view(gw_url)
    finally:
        if gw is not None:
            stop_sits(gw)
        stop_sits(up)
    summary = {}
    for phase, rs in results.items():
        ttfts = [t * 1e3 for t, e in rs if t is not None]
        errors: dict[str, int] = {}
        for _, e in rs:
            if e is not None:
                errors[e] = errors.get(e, 0) + 1
        summary[phase] = {"requests": len(rs),
                          "attainment": sum(1 for t, e in rs if e is None and t is not None and t * 1e3 <= slo_ms) / len(rs),
                          "ttft_p50_ms": pct(ttfts, 0.5), "ttft_p95_ms": pct(ttfts, 0.95), "errors": errors}
    result = {"model": model, "rounds": rounds, "requests_per_phase_round": requests, "concurrency": concurrency,
              "max_tokens": max_tokens, "slo_ttft_ms": slo_ms, "mesh_ttft_budget_ms": budget_ms,
              "fault": {"kind": "first_frame_block", "block_ms": block_ms, "probability": share},
              "phases": summary, "mesh_served_by": served_by, "mesh_escalations": final["escalations"],
              "mesh_skipped": final["skipped"],
              "attainment_ratio": summary["mesh [large, small]"]["attainment"] / max(summary["large directly"]["attainment"], 1e-9)}
    return publish(result, "mesh", _markdown, DOC_BEGIN, DOC_END, json_out, docs_out, plot=_plot)


def _plot(r: dict, path) -> None:
    phases = list(r["phases"])
    grouped_bars(path, phases, {"SLA attainment (TTFT ≤ SLO)": [r["phases"][p]["attainment"] for p in phases]},
                 ylabel="share of requests", title="A faulty large tier: called directly vs through a mesh")


def _markdown(r: dict, command: str, plot: str) -> str:
    f = r["fault"]
    lines = [DOC_BEGIN, "## The mesh in front of a faulty large tier (`sits bench mesh`)", "",
             f"Command: `{command}`  ",
             f"Model `{r['model']}` as both tiers: `large` is a remote unit (a `sits serve` reached over HTTP) with a "
             f"first-frame block of {f['block_ms']:.0f} ms on {f['probability']:.0%} of its requests, `small` a local unit "
             f"(1 instance, 1 thread); the mesh `assist` has tiers `[large, small]` and a TTFT budget of "
             f"{r['mesh_ttft_budget_ms']:.0f} ms. {r['requests_per_phase_round']} streamed chats per phase and round, "
             f"{r['concurrency']} at a time, {r['max_tokens']} tokens, {r['rounds']} rounds, phases alternating. "
             f"SLO: first token at the client within {r['slo_ttft_ms']:.0f} ms. Baseline: the same requests to `large` "
             "directly.", "",
             "| phase | requests | SLA attainment | vs large directly | TTFT p50 ms | TTFT p95 ms | errors |",
             "|---|---|---|---|---|---|---|"]
    base = r["phases"]["large directly"]["attainment"]
    for phase, s in r["phases"].items():
        errs = ", ".join(f"{k} {v}" for k, v in s["errors"].items()) or "0"
        lines.append(f"| {phase} | {s['requests']} | {s['attainment']:.2f} | {s['attainment'] / max(base, 1e-9):.2f}× | "
                     f"{s['ttft_p50_ms']:.0f} | {s['ttft_p95_ms']:.0f} | {errs} |")
    total = sum(r["mesh_served_by"].values()) or 1
    lines += ["", "Which tier answered the mesh's requests: " +
              ", ".join(f"`{t}` {n} ({n / total:.0%})" for t, n in r["mesh_served_by"].items()) +
              f"; escalations {json.dumps(r['mesh_escalations'])}; tiers skipped {json.dumps(r['mesh_skipped'])} "
              "(counted over the whole run). Called directly, the large tier's own SLA breaker opens after its "
              "misses and turns requests away at once (`sla_breaker_open`, a miss here); the mesh skips a tier whose "
              "breaker is open and gives up on one whose first token has not come within the budget.", "",
              f"![attainment]({plot})", "", DOC_END]
    return "\n".join(lines)


def _cli(args: argparse.Namespace) -> int:
    r = run_mesh_bench(args.model, rounds=args.repeats, requests=args.requests, concurrency=args.concurrency,
                       slo_ms=args.slo_ms, budget_ms=args.budget_ms, block_ms=args.block_ms, share=args.fault_share,
                       json_out=args.json, docs_out=args.write_docs)
    print(json.dumps({"phases": r["phases"], "mesh_served_by": r["mesh_served_by"]}, indent=2))
    return 0


def register_cli(subparsers: argparse._SubParsersAction) -> None:
    p = add_bench_command(subparsers, "mesh", "SLA attainment: a faulty large tier directly vs a mesh in front of it",
                          _cli, repeats="rounds (each: both phases)", repeats_default=3)
    p.add_argument("--requests", type=int, default=40, help="requests per phase and round")
    p.add_argument("--concurrency", type=int, default=2, help="requests in flight (default: %(default)s)")
    p.add_argument("--slo-ms", type=float, default=1000.0, help="the TTFT SLO a request attains")
    p.add_argument("--budget-ms", type=float, default=600.0, help="the mesh's TTFT budget")
    p.add_argument("--block-ms", type=float, default=2500.0, help="the fault's first-frame block")
    p.add_argument("--fault-share", type=float, default=0.5, help="share of the large tier's requests it hits")
