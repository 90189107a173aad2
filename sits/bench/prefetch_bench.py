"""``sits bench prefetch``: a two-unit chain (A then B, same session), B scaled to zero before each
chain; TTFT of the call to B with trace-driven pre-warming on vs off, same run, same model.

Each gateway first learns the chain (``--train`` chains), then ``--repeats`` measured chains.
With pre-warming, the call to A starts B's instance, which is ready (or nearly) when B is called.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING

from sits.bench.common import (add_bench_command, bench_command, log, start_sits, stop_sits, wait_until, write_docs,
                               write_json)

if TYPE_CHECKING:
    import httpx

DOC_BEGIN = "<!-- sits bench prefetch: begin -->"
DOC_END = "<!-- sits bench prefetch: end -->"


def _ttft_ms(c: httpx.Client, unit: str, session: str, max_tokens: int) -> float:
    t0 = time.perf_counter()
    body = {"model": unit, "prompt": "the next step of the workflow", "max_tokens": max_tokens, "temperature": 0,
            "stream": True, "ignore_eos": True}
    first = None
    with c.stream("POST", "/v1/completions", json=body, headers={"x-session-id": session}) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if first is None and line.startswith("data: {"):
                first = (time.perf_counter() - t0) * 1e3
    return first


def one_gateway(model_dir: str, prefetch: bool, train: int, repeats: int, a_tokens: int) -> list[float]:
    work = Path(tempfile.mkdtemp(prefix="sits-prefetch-"))
    res = "{device: cpu, kv_cache_mb: 64}"
    (work / "sits.yaml").write_text(
        f"units:\n  - name: a\n    model: {model_dir}\n    scale: {{min_instances: 1}}\n    resources: {res}\n"
        f"  - name: b\n    model: {model_dir}\n    scale: {{min_instances: 0, keep_alive_s: 3600}}\n"
        f"    resources: {res}\n")
    proc, url = start_sits(["up", "--config", str(work / "sits.yaml"), "--data-dir", str(work / "data")]
                           + ([] if prefetch else ["--no-prefetch"]))
    import httpx    # not at the top: `sits --help` imports every benchmark module
    c = httpx.Client(base_url=url, timeout=600)
    out = []
    try:
        wait_until(lambda: [i["state"] for i in c.get("/v1/units/a").json()["instances"]] == ["READY"], 300,
                   "unit a READY")
        for i in range(train + repeats):
            c.post("/v1/units/b/scale", json={"instances": 0}).raise_for_status()
            wait_until(lambda: c.get("/v1/units/b").json()["instances"] == [], 60, "unit b at zero")
            sid = f"chain-{i}"
            _ttft_ms(c, "a", sid, a_tokens)
            ms = _ttft_ms(c, "b", sid, 4)
            if i >= train:
                out.append(ms)
                log(f"prefetch={'on' if prefetch else 'off'} chain {i - train + 1}/{repeats}: TTFT of b {ms:.0f} ms")
    finally:
        stop_sits(proc)
    return out


def run_prefetch_bench(model_dir: str, *, train: int = 6, repeats: int = 5, a_tokens: int = 32,
                       json_out: str | None = None, docs_out: str | None = None) -> dict:
    shown, model_dir = model_dir, str(Path(model_dir).resolve())
    off = one_gateway(model_dir, False, train, repeats, a_tokens)
    on = one_gateway(model_dir, True, train, repeats, a_tokens)
    r = {"model": shown, "train": train, "repeats": repeats, "a_tokens": a_tokens, "host": f"{os.cpu_count()} CPU cores",
         "b_ttft_off_ms": statistics.median(off), "b_ttft_on_ms": statistics.median(on), "off_runs_ms": off,
         "on_runs_ms": on}
    r["ratio_on_vs_off"] = r["b_ttft_on_ms"] / r["b_ttft_off_ms"]
    command = bench_command("prefetch")
    write_json(json_out, r)
    if docs_out:
        lines = [DOC_BEGIN, "## Trace-driven pre-warming (`sits bench prefetch`)", "", f"Command: `{command}`  ",
                 f"Host: {r['host']}; model `{shown}`; chain: unit a ({a_tokens} tokens streamed) then unit b, same "
                 f"session, b scaled to zero before each chain; {train} chains to learn, medians of {repeats}.", "",
                 "| pre-warming | TTFT of b, median ms | runs |", "|---|---|---|",
                 f"| off | {r['b_ttft_off_ms']:.0f} | {', '.join(f'{x:.0f}' for x in off)} |",
                 f"| on | {r['b_ttft_on_ms']:.0f} | {', '.join(f'{x:.0f}' for x in on)} |", "",
                 f"on / off: **{r['ratio_on_vs_off']:.2f}**", "", DOC_END]
        write_docs(Path(docs_out), "\n".join(lines), DOC_BEGIN, DOC_END)
    return r


def _cli(args: argparse.Namespace) -> int:
    r = run_prefetch_bench(args.model, train=args.train, repeats=args.repeats, a_tokens=args.a_tokens,
                           json_out=args.json, docs_out=args.write_docs)
    print(json.dumps({k: v for k, v in r.items() if not k.endswith("_runs_ms")}, indent=2))
    return 0


def register_cli(subparsers: argparse._SubParsersAction) -> None:
    p = add_bench_command(subparsers, "prefetch", "two-unit chain: TTFT of the second call with pre-warming on vs off",
                          _cli, repeats="chains measured, median reported", repeats_default=5)
    p.add_argument("--train", type=int, default=6, help="chains run first so the gateway learns the chain")
    p.add_argument("--a-tokens", type=int, default=32, help="tokens the first call streams")
