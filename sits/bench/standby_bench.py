"""``sits bench standby``: an instance start forked from the zygote against one handed to a process
standing by (forked earlier, its device set up), same zygote, same model, alternating in one run.

Each start is the runtime's own: ``ZygoteClient.fork`` (the zygote asked to keep one standby for the
device, or none) and ``InstanceBackend.spawn`` with an urgent start's configuration (no warm-up, KV
pool faulted in when idle), then one streamed token; timed from asking for the instance to that
token. A second request to the same instance is the warm figure. Both paths copy the weights from
the zygote's host copy; on a GPU the standby has also created its CUDA context (and cuBLAS's
handle) and page-locked that copy before the start is asked for (a standby's start is timed once
the zygote reports it ready). On a CPU there is nothing to set up ahead, and the two paths should be
level. No HTTP server is involved (a GPU image without its packages runs it).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time
from dataclasses import asdict

from sits.bench.common import add_bench_command, grouped_bars, log, publish

DOC_BEGIN = "<!-- sits bench standby: begin -->"
DOC_END = "<!-- sits bench standby: end -->"
PROMPT = "The Python language reference says that"
READY_TIMEOUT_S = 120.0      # longest wait for a new standby's set-up (context, page-locking) before a timed start
MODES = ("fork", "standby")


async def _start_once(zygote, cfg, tag: str) -> dict:
    from sits.engine.sampling_params import SamplingParams
    from sits.runtime.instance_client import InstanceBackend

    params = SamplingParams(max_tokens=1, temperature=0.0)
    t0 = time.perf_counter()
    backend = await InstanceBackend.spawn(cfg, launcher=zygote.fork)
    try:
        async for _ in backend.stream(backend.prepare(PROMPT, params, request_id=f"cold-{tag}")):
            pass
        cold_ms = (time.perf_counter() - t0) * 1e3
        t1 = time.perf_counter()
        async for _ in backend.stream(backend.prepare(PROMPT + " it", params, request_id=f"warm-{tag}")):
            pass
        warm_ms = (time.perf_counter() - t1) * 1e3
        return {"cold_ms": cold_ms, "warm_ms": warm_ms, "standby": backend.proc.standby,
                "phases_ms": dict(backend.cold_start.get("phases_ms", {}))}
    finally:
        await backend.shutdown()


async def _run(model_dir: str, device: str, dtype: str, threads: int | None, repeats: int,
               ready_timeout_s: float) -> dict:
    from sits.engine.config import EngineConfig
    from sits.runtime.zygote import LOADER_DEADLINE_S, ZygoteClient

    cfg = EngineConfig(model=model_dir, device=device, dtype=dtype, kv_cache_memory_mb=64, threads=threads,
                       warmup=False, kv_touch="background")
    zygote = await ZygoteClient.start()
    runs: dict[str, list[dict]] = {m: [] for m in MODES}
    try:
        zygote.preload(asdict(cfg))           # the zygote builds the model (a GPU unit's: in host memory,
        zygote.standby(device, 0)             # by a loader process), and both paths start from it
        built = await zygote.wait_preloaded(asdict(cfg), LOADER_DEADLINE_S)
        if not built or not built["ok"]:
            raise RuntimeError(f"the zygote could not preload {model_dir} for {device} (its stderr says why)")
        await _start_once(zygote, cfg, "first")    # untimed: the first start pays one-time costs
        for i in range(repeats):
            for mode in (MODES if i % 2 == 0 else MODES[::-1]):       # alternating, order reversed each round
                zygote.standby(device, 1 if mode == "standby" else 0)
                if mode == "standby" and not await zygote.wait_standbys(device, 1, ready_timeout_s):
                    raise RuntimeError(f"no standby for {device} was ready within {ready_timeout_s:g} s")
                run = await _start_once(zygote, cfg, f"{i}-{mode}")
                if run["standby"] != (mode == "standby"):
                    raise RuntimeError(f"a {mode} start was {'' if run['standby'] else 'not '}handed to a standby")
                runs[mode].append(run)
                log(f"{mode} start {i + 1}/{repeats}: first token {run['cold_ms']:.0f} ms, warm {run['warm_ms']:.1f} "
                    f"ms; {run['phases_ms']}")
    finally:
        await zygote.shutdown()
    return runs


def run_standby_bench(model_dir: str, *, device: str = "cpu", dtype: str = "auto", threads: int | None = None,
                      repeats: int = 3, ready_timeout_s: float = READY_TIMEOUT_S, json_out: str | None = None,
                      docs_out: str | None = None) -> dict:
    runs = asyncio.run(_run(model_dir, device, dtype, threads, repeats, ready_timeout_s))
    result: dict = {"model": model_dir, "device": device, "dtype": dtype, "repeats": repeats, "modes": {}}
    for mode, rs in runs.items():
        phases = list(dict.fromkeys(k for r in rs for k in r["phases_ms"]))
        result["modes"][mode] = {
            "cold_ms": statistics.median(r["cold_ms"] for r in rs),
            "warm_ms": statistics.median(r["warm_ms"] for r in rs),
            "cold_runs_ms": [r["cold_ms"] for r in rs],
            "phases_ms": {k: statistics.median(r["phases_ms"].get(k, 0.0) for r in rs) for k in phases}}
    result["ratio_standby_vs_fork"] = result["modes"]["standby"]["cold_ms"] / result["modes"]["fork"]["cold_ms"]
    return publish(result, "standby", _markdown, DOC_BEGIN, DOC_END, json_out, docs_out, plot=_plot)


def _plot(result: dict, path) -> None:
    phases = list(dict.fromkeys(k for m in MODES for k in result["modes"][m]["phases_ms"]))
    series = {m: [result["modes"][m]["phases_ms"].get(k, 0.0) for k in phases] for m in MODES}
    grouped_bars(path, phases, series, ylabel="ms (median)",
                 title=f"Instance start phases, fork vs standby ({result['device']}, {result['dtype']})")


def _markdown(r: dict, command: str, plot_path: str) -> str:
    lines = [DOC_BEGIN, "## Standby processes (`sits bench standby`)", "", f"Command: `{command}`  ",
             f"Model `{r['model']}` on {r['device']} ({r['dtype']}); an urgent start (no warm-up) from the zygote, "
             f"medians of {r['repeats']} starts per path, alternating; one streamed token.", "",
             "| path | first token, median ms | runs | warm, median ms |", "|---|---|---|---|"]
    for m in MODES:
        d = r["modes"][m]
        lines.append(f"| {m} | {d['cold_ms']:.0f} | {', '.join(f'{x:.0f}' for x in d['cold_runs_ms'])} | "
                     f"{d['warm_ms']:.1f} |")
    lines += ["", f"standby / fork: **{r['ratio_standby_vs_fork']:.2f}**", "",
              "| phase (median ms) | " + " | ".join(MODES) + " |", "|---|" + "---|" * len(MODES)]
    for k in dict.fromkeys(k for m in MODES for k in r["modes"][m]["phases_ms"]):
        lines.append(f"| {k} | " + " | ".join(f"{r['modes'][m]['phases_ms'].get(k, 0.0):.1f}" for m in MODES) + " |")
    lines += ["", f"![start phases]({plot_path})", "", DOC_END]
    return "\n".join(lines)


def _cli(args: argparse.Namespace) -> int:
    r = run_standby_bench(args.model, device=args.device, dtype=args.dtype, threads=args.threads,
                          repeats=args.repeats, ready_timeout_s=args.ready_timeout_s, json_out=args.json,
                          docs_out=args.write_docs)
    print(json.dumps({m: {k: v for k, v in d.items() if k != "cold_runs_ms"} for m, d in r["modes"].items()}
                     | {"ratio_standby_vs_fork": round(r["ratio_standby_vs_fork"], 3)}, indent=2))
    return 0


def register_cli(subparsers: argparse._SubParsersAction) -> None:
    p = add_bench_command(subparsers, "standby", "instance start: forked from the zygote vs handed to a standby",
                          _cli, threads="CPU threads per instance", repeats="starts per path, median reported",
                          repeats_default=3)
    p.add_argument("--device", default="cpu", help="the instances' device (cpu, cuda, cuda:N)")
    p.add_argument("--dtype", default="auto", help="the instances' dtype")
    p.add_argument("--ready-timeout-s", type=float, default=READY_TIMEOUT_S,
                   help="the longest wait for a new standby to be ready (its device set up) before its start is timed")
