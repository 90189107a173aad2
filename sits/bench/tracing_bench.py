"""What tracing costs a served request: ``sits serve`` with spans off (the default) vs every span
recorded and kept in memory (``--trace-exporter memory``: the work of an exporter, without a
network), the same workload against both in one run, TTFT and server overhead as ratios."""

from __future__ import annotations

import argparse
import json
import os

from sits.bench.common import add_bench_command, log, publish, start_sits, stop_sits
from sits.bench.serve_bench import sweep

DOC_BEGIN = "<!-- sits bench tracing: begin -->"
DOC_END = "<!-- sits bench tracing: end -->"
MODES = {"off": ["--trace-exporter", "none"], "on": ["--trace-exporter", "memory"]}


def run_tracing_bench(model_dir: str, *, concurrency: list[int], repeats: int, rounds: int = 2,
                      json_out: str | None = None, docs_out: str | None = None, engine: str = "process") -> dict:
    """Both servers up at once, taking turns run by run (so drift on a busy host hits both alike);
    ``rounds`` fresh pairs of servers, medians over all runs."""
    runs: dict[str, list[list[dict]]] = {m: [] for m in MODES}
    for _ in range(rounds):
        started = {}
        try:
            for mode, args in MODES.items():
                started[mode] = start_sits(["serve", "--model", model_dir, "--engine", engine, *args])
            _, levels = sweep({mode: url for mode, (_, url) in started.items()}, None, concurrency, None,
                              48, 16, True, repeats)
            for mode in MODES:
                runs[mode].append(levels[mode])
        finally:
            for proc, _ in started.values():
                stop_sits(proc)
    table = []
    for i, c in enumerate(concurrency):
        row = {"concurrency": c}
        for mode in MODES:
            vals = sorted(lv[i]["ttft_p50_ms"] for lv in runs[mode])
            over = sorted(lv[i]["overhead_p50_ms"] for lv in runs[mode])
            row[f"ttft_p50_ms_{mode}"] = vals[len(vals) // 2]
            row[f"overhead_p50_ms_{mode}"] = over[len(over) // 2]
        row["ttft_ratio"] = row["ttft_p50_ms_on"] / row["ttft_p50_ms_off"]
        row["overhead_delta_ms"] = row["overhead_p50_ms_on"] - row["overhead_p50_ms_off"]
        table.append(row)
        log(f"{c} streams: TTFT p50 off {row['ttft_p50_ms_off']:.1f} ms, on {row['ttft_p50_ms_on']:.1f} ms "
            f"(x{row['ttft_ratio']:.3f}); server overhead +{row['overhead_delta_ms']:.2f} ms")
    result = {"model": model_dir, "engine": engine, "rounds": rounds, "repeats": repeats, "table": table,
              "host": f"{os.cpu_count()} CPU cores, client and server on the same host"}
    return publish(result, "tracing", _markdown, DOC_BEGIN, DOC_END, json_out, docs_out)


def _markdown(r: dict, command: str) -> str:
    lines = [DOC_BEGIN, "## Tracing overhead (`sits bench tracing`)", "", f"Command: `{command}`  ",
             f"{r['host']}; engine mode {r['engine']}; chat completions, 48-word prompts, 16 tokens; the off and "
             f"on servers up together, taking turns run by run, {r['rounds']} pair(s) of servers, medians of all "
             "runs. \"on\" records every span of every request (all levels kept) into the in-memory exporter.", "",
             "| streams | TTFT p50 off (ms) | TTFT p50 on (ms) | on / off | server overhead p50 off (ms) | on (ms) |",
             "|---:|---:|---:|---:|---:|---:|"]
    for row in r["table"]:
        lines.append(f"| {row['concurrency']} | {row['ttft_p50_ms_off']:.1f} | {row['ttft_p50_ms_on']:.1f} | "
                     f"{row['ttft_ratio']:.3f} | {row['overhead_p50_ms_off']:.2f} | {row['overhead_p50_ms_on']:.2f} |")
    lines += ["", DOC_END]
    return "\n".join(lines)


def _cli(args: argparse.Namespace) -> int:
    r = run_tracing_bench(args.model, concurrency=[int(c) for c in args.concurrency.split(",")],
                          repeats=args.repeats, rounds=args.rounds, json_out=args.json, docs_out=args.write_docs,
                          engine=args.engine)
    print(json.dumps(r["table"], indent=2))
    return 0


def register_cli(subparsers: argparse._SubParsersAction) -> None:
    p = add_bench_command(subparsers, "tracing", "served TTFT with spans off vs every span recorded (same run)", _cli,
                          repeats="runs per level and round", repeats_default=2)
    p.add_argument("--concurrency", default="1,8", help="comma-separated stream counts")
    p.add_argument("--rounds", type=int, default=2, help="off/on alternations (a fresh pair of servers each)")
    p.add_argument("--engine", default="process", choices=["process", "thread"], help="the servers' engine mode")
