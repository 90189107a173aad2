"""``sits bench serve``: concurrent streaming clients against a live server, and the server's overhead.

Each client streams ``/v1/chat/completions`` (or ``/v1/completions``) with ``X-SITS-Stream-Meta: 1``,
so every response reports the engine's own TTFT for that very request (``engine_ttft_us`` on the
first token chunk). The baseline is therefore measured in the same run, request by request:
HTTP overhead = TTFT seen by the client - TTFT inside the engine (validation, tokenization, HTTP
parsing, SSE framing and the loopback network). The client's TTFT ends when the bytes of the first
token chunk are read from its socket; the overhead up to when this client has parsed them is
reported beside it (``overhead_parsed``: the client's own share, which a client on another host
spends on its own cores). Closed loop: C clients each send their next request
as soon as the previous one ends. Prompts are seeded random words, distinct per request, so the
prefix cache does not flatter the numbers.

``--url`` benchmarks a running server; ``--model DIR`` starts ``sits serve`` in a child process on
a free port (a separate process, so the client never shares the server's GIL) and stops it after.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import time
from pathlib import Path

from sits.bench.common import add_bench_command, log, pct, publish, revision, start_sits, stop_sits
from sits.bench.stream_client import RequestResult, StreamClient, make_prompt, one_request

DOC_BEGIN = "<!-- sits bench serve: begin -->"
DOC_END = "<!-- sits bench serve: end -->"

async def run_level(url: str, model: str, concurrency: int, num_requests: int, prompt_words: int,
                    max_tokens: int, chat: bool, seed: int) -> dict:
    rng = random.Random(seed)
    prompts = [make_prompt(rng, prompt_words) for _ in range(num_requests)]
    results: list[RequestResult] = []
    next_i = 0
    async def worker():
        nonlocal next_i
        client = StreamClient(url)
        try:
            while next_i < num_requests:
                i = next_i
                next_i += 1
                results.append(await one_request(client, model, prompts[i], max_tokens, chat))
        finally:
            await client.close()

    t0 = time.perf_counter()
    await asyncio.gather(*[worker() for _ in range(concurrency)])
    wall = time.perf_counter() - t0
    ok = [r for r in results if r.ok]
    ttft = [r.ttft_s for r in ok]
    eng = [r.engine_ttft_s for r in ok]
    over = [r.ttft_s - r.engine_ttft_s for r in ok]
    over_parsed = [r.ttft_parsed_s - r.engine_ttft_s for r in ok]
    itl = [x for r in ok for x in r.itl_s]
    e2e = [r.e2e_s for r in ok]
    return {
        "concurrency": concurrency, "requests": len(results), "errors": len(results) - len(ok),
        "error_samples": [r.error for r in results if not r.ok][:3],
        "ttft_p50_ms": pct(ttft, 0.5) * 1e3, "ttft_p99_ms": pct(ttft, 0.99) * 1e3,
        "engine_ttft_p50_ms": pct(eng, 0.5) * 1e3, "engine_ttft_p99_ms": pct(eng, 0.99) * 1e3,
        "overhead_p50_ms": pct(over, 0.5) * 1e3, "overhead_p99_ms": pct(over, 0.99) * 1e3,
        "overhead_parsed_p50_ms": pct(over_parsed, 0.5) * 1e3,
        "itl_p50_ms": pct(itl, 0.5) * 1e3, "itl_p99_ms": pct(itl, 0.99) * 1e3,
        "e2e_p50_ms": pct(e2e, 0.5) * 1e3, "e2e_p99_ms": pct(e2e, 0.99) * 1e3,
        "throughput_tok_s": sum(r.output_tokens for r in ok) / wall if wall else 0.0,
        "prompt_tokens_mean": statistics.fmean([r.prompt_tokens for r in ok]) if ok else 0.0,
        "wall_s": wall,
    }


def _median_runs(runs: list[dict]) -> dict:
    out = dict(runs[0])
    for k, v in runs[0].items():
        if isinstance(v, float):
            out[k] = statistics.median(r[k] for r in runs)
    out["errors"] = sum(r["errors"] for r in runs)
    out["requests"] = sum(r["requests"] for r in runs)
    out["runs"] = len(runs)
    return out


# -- report -----------------------------------------------------------------------------------------
def _plot(modes: dict[str, list[dict]], path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b, c) = plt.subplots(1, 3, figsize=(16, 4))
    width = 0.8 / max(1, len(modes))
    for j, (mode, levels) in enumerate(modes.items()):
        cs = [lv["concurrency"] for lv in levels]
        a.plot(cs, [lv["ttft_p50_ms"] for lv in levels], "o-", label=f"{mode}: via HTTP p50")
        a.plot(cs, [lv["engine_ttft_p50_ms"] for lv in levels], "s--", label=f"{mode}: in the engine p50")
        b.bar([i + (j - (len(modes) - 1) / 2) * width for i in range(len(cs))],
              [lv["overhead_p50_ms"] for lv in levels], width, label=mode)
        c.plot(cs, [lv["throughput_tok_s"] for lv in levels], "o-", label=mode)
    cs = [lv["concurrency"] for lv in next(iter(modes.values()))]
    a.set_xscale("log", base=2)
    a.set(xlabel="concurrent streams", ylabel="ms", title="time to first token")
    a.legend(fontsize=7)
    b.axhline(2.0, color="red", linestyle="--", label="target p50 ≤ 2 ms")
    b.set_xticks(range(len(cs)), [str(x) for x in cs])
    b.set(xlabel="concurrent streams", ylabel="ms", title="server overhead p50: HTTP TTFT − engine TTFT")
    b.legend(fontsize=7)
    c.set_xscale("log", base=2)
    c.set(xlabel="concurrent streams", ylabel="output tokens / s", title="throughput")
    c.legend(fontsize=7)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


_COLS = ("| streams | requests | errors | TTFT p50 ms | TTFT p99 ms | engine TTFT p50 ms | overhead p50 ms | "
         "overhead p99 ms | overhead p50 incl. client parse ms | ITL p50 ms | ITL p99 ms | e2e p50 ms | e2e p99 ms | "
         "tok/s |", "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")


def _markdown(result: dict, command: str, plot: str | None) -> str:
    modes = result["modes"]
    first = next(iter(modes.values()))
    lines = [DOC_BEGIN, "## Serving over HTTP (`sits bench serve`)", "", f"Command: `{command}`  ",
             f"Host: {result['host']}; model `{result['model']}`; {result['endpoint']}, prompts of "
             f"{result['prompt_words']} words (≈{first[0]['prompt_tokens_mean']:.0f} tokens), "
             f"{result['max_tokens']} output tokens, greedy; medians of {result['repeats']} run(s) per level, "
             "the servers taking turns run by run. "
             "Server overhead = TTFT seen by the client (the first token chunk's bytes read from its socket) − "
             "the engine's own TTFT for the same request (from the stream metadata), so its baseline is measured "
             "request by request in the same run; the column beside it adds this client's own parsing.", ""]
    for mode, levels in modes.items():
        lines += [f"### engine mode `{mode}`", "", *_COLS]
        for lv in levels:
            lines.append(f"| {lv['concurrency']} | {lv['requests']} | {lv['errors']} | {lv['ttft_p50_ms']:.1f} | "
                         f"{lv['ttft_p99_ms']:.1f} | {lv['engine_ttft_p50_ms']:.1f} | {lv['overhead_p50_ms']:.2f} | "
                         f"{lv['overhead_p99_ms']:.2f} | {lv.get('overhead_parsed_p50_ms', 0.0):.2f} | "
                         f"{lv['itl_p50_ms']:.1f} | {lv['itl_p99_ms']:.1f} | "
                         f"{lv['e2e_p50_ms']:.0f} | {lv['e2e_p99_ms']:.0f} | {lv['throughput_tok_s']:.0f} |")
        lines.append("")
    if "process" in modes and "thread" in modes:
        lines += ["### process / thread (same run)", "",
                  "| streams | TTFT p50 | TTFT p99 | overhead p50 | ITL p50 | throughput |", "|---|---|---|---|---|---|"]
        for p, t in zip(modes["process"], modes["thread"]):
            def r(k):
                return f"{p[k] / t[k]:.2f}" if t[k] else "-"
            lines.append(f"| {p['concurrency']} | {r('ttft_p50_ms')} | {r('ttft_p99_ms')} | {r('overhead_p50_ms')} | "
                         f"{r('itl_p50_ms')} | {r('throughput_tok_s')} |")
        lines.append("")
    for mode, label in result.get("baselines", {}).items():
        lines += [f"### `{mode}` / `{label}` (same run)", "",
                  "| streams | TTFT p50 | overhead p50 | overhead p99 | ITL p50 | throughput |", "|---|---|---|---|---|---|"]
        for a, b in zip(modes[mode], modes[label]):
            def q(k):
                return f"{a[k] / b[k]:.2f}" if b[k] else "-"
            lines.append(f"| {a['concurrency']} | {q('ttft_p50_ms')} | {q('overhead_p50_ms')} | {q('overhead_p99_ms')} | "
                         f"{q('itl_p50_ms')} | {q('throughput_tok_s')} |")
        lines.append("")
    lines += ["Target: server overhead ≤ 2 ms at p50.", ""]
    if plot:
        lines += [f"![serve benchmark]({plot})", ""]
    lines.append(DOC_END)
    return "\n".join(lines)


def _warm(url: str, model: str | None, prompt_words: int, chat: bool, label: str) -> str:
    import httpx
    models = httpx.get(url + "/v1/models", timeout=10).json()["data"]
    name = model or models[0]["id"]
    log(f"[{label}] warming up {url} ({name})")
    asyncio.run(run_level(url, name, 2, 4, prompt_words, 4, chat, seed=999))
    return name


def sweep(targets: dict[str, str], model: str | None, concurrency: list[int], num_requests: int | None,
          prompt_words: int, max_tokens: int, chat: bool, repeats: int) -> tuple[str, dict[str, list[dict]]]:
    """Every level against every target (label -> URL), the targets taking turns run by run, so a
    drift of the host (another process, thermal state) lands on all of them alike; the order of the
    turns reverses every run, so no target always goes first."""
    names = {label: _warm(url, model, prompt_words, chat, label) for label, url in targets.items()}
    out: dict[str, list[dict]] = {label: [] for label in targets}
    for c in concurrency:
        n = num_requests or max(16, 2 * c)
        runs: dict[str, list[dict]] = {label: [] for label in targets}
        for r in range(repeats):
            for label, url in (list(targets.items())[::-1] if r % 2 else targets.items()):
                lv = asyncio.run(run_level(url, names[label], c, n, prompt_words, max_tokens, chat, seed=c * 100 + r))
                log(f"[{label}] {c} streams, run {r + 1}/{repeats}: ttft p50 {lv['ttft_p50_ms']:.1f} ms "
                    f"(engine {lv['engine_ttft_p50_ms']:.1f}), overhead p50 {lv['overhead_p50_ms']:.2f} ms, "
                    f"itl p50 {lv['itl_p50_ms']:.1f} ms, {lv['throughput_tok_s']:.0f} tok/s, errors {lv['errors']}")
                runs[label].append(lv)
        for label in targets:
            out[label].append(_median_runs(runs[label]))
    return next(iter(names.values())), out


def run_serve_bench(*, url: str | None, model_dir: str | None, model: str | None, concurrency: list[int],
                    num_requests: int | None, prompt_words: int, max_tokens: int, chat: bool, repeats: int,
                    json_out: str | None, docs_out: str | None, engines: list[str] | None = None,
                    server_args: list[str] | None = None, baseline_args: list[str] | None = None,
                    baseline_code: str | None = None) -> dict:
    """Sweep concurrency against ``url``, or against ``sits serve --model model_dir`` once per engine
    mode; ``baseline_args`` adds, per mode, a server started with those arguments (e.g.
    ``--no-hot-path``), ``baseline_code`` one running the code of another checkout (old vs new);
    either is measured in the same run, the servers taking turns, and reported as ratios."""
    if url is not None:
        name, modes = sweep({"server": url}, model, concurrency, num_requests, prompt_words, max_tokens, chat,
                            repeats)
        baselines: dict[str, str] = {}
    else:
        if model_dir is None:
            raise ValueError("give --url of a running server or --model DIR to start one")
        variants: dict[str, tuple[list[str], str | None]] = {}
        baselines = {}
        for mode in engines or ["process"]:
            variants[mode] = (["--engine", mode], None)
            if baseline_args or baseline_code:
                label = f"{mode}, {' '.join(baseline_args or [])}".rstrip(", ")
                if baseline_code:
                    label += f" (code at {revision(baseline_code)})"
                variants[label] = (["--engine", mode, *(baseline_args or [])], baseline_code)
                baselines[mode] = label
        started: dict[str, tuple] = {}
        try:
            for label, (extra, code) in variants.items():
                started[label] = start_sits(["serve", "--model", model_dir, *extra, *(server_args or [])],
                                            code_dir=code)
            name, modes = sweep({label: u for label, (_, u) in started.items()}, model, concurrency, num_requests,
                                prompt_words, max_tokens, chat, repeats)
        finally:
            for proc, _ in started.values():
                stop_sits(proc)
    result = {"url": url, "model": model_dir or name, "endpoint": "/v1/chat/completions" if chat else "/v1/completions",
              "prompt_words": prompt_words, "max_tokens": max_tokens, "repeats": repeats, "modes": modes,
              "baselines": baselines, "host": f"{os.cpu_count()} CPU cores, client and server on the same host"}
    return publish(result, "serve", _markdown, DOC_BEGIN, DOC_END, json_out, docs_out,
                   plot=lambda r, path: _plot(r["modes"], path))


def _cli(args: argparse.Namespace) -> int:
    server_args = []
    if args.threads:
        server_args += ["--threads", str(args.threads)]
    if args.quick:
        concurrency, repeats = [1, 8], args.repeats or 1
    else:
        concurrency, repeats = [int(c) for c in args.concurrency.split(",")], args.repeats or 3
    result = run_serve_bench(url=args.url, model_dir=args.model, model=args.served_model, concurrency=concurrency,
                             num_requests=args.requests, prompt_words=args.prompt_words, max_tokens=args.max_tokens,
                             chat=not args.completions, repeats=repeats, json_out=args.json,
                             docs_out=args.write_docs, engines=args.engine.split(","), server_args=server_args,
                             baseline_args=args.baseline_args.split() if args.baseline_args else None,
                             baseline_code=args.baseline_code)
    levels = [lv for lvs in result["modes"].values() for lv in lvs]
    print(json.dumps({mode: [{k: (round(v, 2) if isinstance(v, float) else v) for k, v in lv.items()
                              if k != "error_samples"} for lv in lvs] for mode, lvs in result["modes"].items()},
                     indent=2))
    return 1 if any(lv["errors"] for lv in levels) else 0


def register_cli(subparsers: argparse._SubParsersAction) -> None:
    p = add_bench_command(subparsers, "serve",
                          "concurrent streaming clients over HTTP; TTFT/ITL/e2e and server overhead", _cli,
                          model=False, threads="server CPU threads, with --model",
                          repeats="runs per level, median reported (default: 3)")
    where = p.add_mutually_exclusive_group(required=True)
    where.add_argument("--url", help="a running server (e.g. http://127.0.0.1:8000)")
    where.add_argument("--model", help="model directory: start `sits serve` on it for the run")
    p.add_argument("--served-model", default=None, help="model name to request (default: the first served)")
    p.add_argument("--concurrency", default="1,4,16,64", help="comma-separated stream counts")
    p.add_argument("--requests", type=int, default=None, help="requests per level (default: max(16, 2*C))")
    p.add_argument("--prompt-words", type=int, default=48, help="words per prompt")
    p.add_argument("--max-tokens", type=int, default=32, help="tokens per response at most")
    p.add_argument("--completions", action="store_true", help="use /v1/completions instead of chat")
    p.add_argument("--engine", default="process,thread",
                   help="with --model: engine modes to sweep, comma-separated (two: an A/B)")
    p.add_argument("--baseline-args", default=None,
                   help="with --model: per engine mode, also a server with these arguments (e.g. --no-hot-path), "
                        "measured in the same run, runs alternating; reported as ratios")
    p.add_argument("--baseline-code", default=None, metavar="CHECKOUT",
                   help="with --model: per engine mode, also a server running the sits package of another checkout "
                        "(e.g. `git worktree add /tmp/old HEAD~1`): old vs new code in the same run")
    p.add_argument("--quick", action="store_true", help="levels 1 and 8, one run (smoke)")
