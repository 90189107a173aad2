"""``sits bench serve``: concurrent streaming clients against a live server, and the server's overhead.

Each client streams ``/v1/chat/completions`` (or ``/v1/completions``) with ``X-SITS-Stream-Meta: 1``,
so every response reports the engine's own TTFT for that very request (``engine_ttft_us`` on the
first token chunk). The baseline is therefore measured in the same run, request by request:
HTTP overhead = TTFT seen by the client - TTFT inside the engine (validation, tokenization, HTTP
parsing, SSE framing and the loopback network). Closed loop: C clients each send their next request
as soon as the previous one ends. Prompts are seeded random words, distinct per request, so the
prefix cache does not flatter the numbers.

``--url`` benchmarks a running server; ``--model DIR`` starts ``sits serve`` in a child process on
a free port (a separate process, so the client never shares the server's GIL) and stops it after.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from sits.bench.common import bench_command, log, pct, start_sits, stop_sits, write_docs, write_json

DOC_BEGIN = "<!-- sits bench serve: begin -->"
DOC_END = "<!-- sits bench serve: end -->"

_WORDS = ("time river light house music window garden story paper market winter engine "
          "mountain letter silver morning people question answer number system water city "
          "language machine world family evening forest camera bridge school dinner planet").split()


@dataclass(slots=True)
class RequestResult:
    ok: bool
    ttft_s: float = 0.0               # client: request sent -> first token chunk received
    engine_ttft_s: float = 0.0        # engine: arrival -> first token (from the stream metadata)
    e2e_s: float = 0.0
    itl_s: list[float] = field(default_factory=list)
    output_tokens: int = 0
    prompt_tokens: int = 0
    error: str | None = None


def make_prompt(rng: random.Random, words: int) -> str:
    return " ".join(rng.choice(_WORDS) for _ in range(words))


class StreamClient:
    """A lean HTTP/1.1 streaming client on one keep-alive connection (asyncio streams, no framework).

    The benchmark measures the server, so the client must add as little as it can: it reads the
    chunked SSE body as bytes and parses JSON only where it needs numbers (the first token chunk's
    metadata and the usage chunk).
    """

    def __init__(self, url: str):
        u = httpx.URL(url)
        self.host, self.port = u.host, u.port or 80
        self.reader: asyncio.StreamReader | None = None
        self.writer: asyncio.StreamWriter | None = None

    async def _connect(self) -> None:
        self.reader, self.writer = await asyncio.open_connection(self.host, self.port)

    async def close(self) -> None:
        if self.writer is not None:
            self.writer.close()

    async def post_stream(self, path: str, body: bytes):
        """Yield (arrival time, event bytes) for each SSE event of the response; raise on non-200."""
        if self.writer is None or self.writer.is_closing():
            await self._connect()
        head = (f"POST {path} HTTP/1.1\r\nHost: {self.host}:{self.port}\r\nContent-Type: application/json\r\n"
                f"Content-Length: {len(body)}\r\nX-SITS-Stream-Meta: 1\r\nAccept: text/event-stream\r\n\r\n")
        self.writer.write(head.encode() + body)
        r = self.reader
        status = await r.readline()
        headers = {}
        while (line := await r.readline()) not in (b"\r\n", b""):
            k, _, v = line.decode("latin-1").partition(":")
            headers[k.strip().lower()] = v.strip()
        code = int(status.split()[1])
        if headers.get("transfer-encoding") != "chunked":
            data = await r.readexactly(int(headers.get("content-length", "0")))
            if code != 200:
                raise RuntimeError(f"HTTP {code}: {data[:200]!r}")
            return
        buf = b""
        while True:
            size = int((await r.readline()).strip(), 16)
            if size == 0:
                await r.readline()
                break
            buf += await r.readexactly(size)
            await r.readexactly(2)
            now = time.perf_counter()
            while b"\n\n" in buf:
                event, buf = buf.split(b"\n\n", 1)
                yield now, event
        if headers.get("connection") == "close":
            await self.close()


async def one_request(client: StreamClient, model: str, prompt: str, max_tokens: int, chat: bool) -> RequestResult:
    path = "/v1/chat/completions" if chat else "/v1/completions"
    body = {"model": model, "max_tokens": max_tokens, "temperature": 0, "stream": True, "ignore_eos": True,
            "stream_options": {"include_usage": True}}
    if chat:
        body["messages"] = [{"role": "user", "content": prompt}]
    else:
        body["prompt"] = prompt
    res = RequestResult(ok=False)
    payload = json.dumps(body).encode()
    t0 = time.perf_counter()
    last = None
    try:
        async for now, event in client.post_stream(path, payload):
            if event == b"data: [DONE]":
                continue          # read on to the end of the chunked body: the connection is reused
            if b'"usage":{' in event:
                usage = json.loads(event[6:]).get("usage") or {}
                res.output_tokens = usage.get("completion_tokens", 0)
                res.prompt_tokens = usage.get("prompt_tokens", 0)
            elif b'"stage":"prefill"' in event or b'"stage":"decode"' in event:
                if last is None:
                    res.ttft_s = now - t0
                    meta = json.loads(event[6:])["sits"]
                    res.engine_ttft_s = meta.get("engine_ttft_us", 0) / 1e6
                else:
                    res.itl_s.append(now - last)
                last = now
            elif event.startswith(b'data: {"error"'):
                res.error = json.loads(event[6:])["error"].get("code")
                return res
        res.e2e_s = time.perf_counter() - t0
        res.ok = last is not None
    except (OSError, RuntimeError, ValueError, asyncio.IncompleteReadError) as e:
        res.error = f"{type(e).__name__}: {e}"
        await client.close()
        client.writer = None
    return res


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
    itl = [x for r in ok for x in r.itl_s]
    e2e = [r.e2e_s for r in ok]
    return {
        "concurrency": concurrency, "requests": len(results), "errors": len(results) - len(ok),
        "error_samples": [r.error for r in results if not r.ok][:3],
        "ttft_p50_ms": pct(ttft, 0.5) * 1e3, "ttft_p99_ms": pct(ttft, 0.99) * 1e3,
        "engine_ttft_p50_ms": pct(eng, 0.5) * 1e3, "engine_ttft_p99_ms": pct(eng, 0.99) * 1e3,
        "overhead_p50_ms": pct(over, 0.5) * 1e3, "overhead_p99_ms": pct(over, 0.99) * 1e3,
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
         "overhead p99 ms | ITL p50 ms | ITL p99 ms | e2e p50 ms | e2e p99 ms | tok/s |",
         "|---|---|---|---|---|---|---|---|---|---|---|---|---|")


def _markdown(result: dict, command: str, plot: str | None) -> str:
    modes = result["modes"]
    first = next(iter(modes.values()))
    lines = [DOC_BEGIN, "## Serving over HTTP (`sits bench serve`)", "", f"Command: `{command}`  ",
             f"Host: {result['host']}; model `{result['model']}`; {result['endpoint']}, prompts of "
             f"{result['prompt_words']} words (≈{first[0]['prompt_tokens_mean']:.0f} tokens), "
             f"{result['max_tokens']} output tokens, greedy; medians of {result['repeats']} run(s) per level. "
             "Server overhead = TTFT seen by the client − the engine's own TTFT for the same request "
             "(from the stream metadata), so its baseline is measured request by request in the same run.", ""]
    for mode, levels in modes.items():
        lines += [f"### engine mode `{mode}`", "", *_COLS]
        for lv in levels:
            lines.append(f"| {lv['concurrency']} | {lv['requests']} | {lv['errors']} | {lv['ttft_p50_ms']:.1f} | "
                         f"{lv['ttft_p99_ms']:.1f} | {lv['engine_ttft_p50_ms']:.1f} | {lv['overhead_p50_ms']:.2f} | "
                         f"{lv['overhead_p99_ms']:.2f} | {lv['itl_p50_ms']:.1f} | {lv['itl_p99_ms']:.1f} | "
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
    lines += ["Target: server overhead ≤ 2 ms at p50.", ""]
    if plot:
        lines += [f"![serve benchmark]({plot})", ""]
    lines.append(DOC_END)
    return "\n".join(lines)


def sweep(url: str, model: str | None, concurrency: list[int], num_requests: int | None, prompt_words: int,
          max_tokens: int, chat: bool, repeats: int, label: str) -> tuple[str, list[dict]]:
    models = httpx.get(url + "/v1/models", timeout=10).json()["data"]
    name = model or models[0]["id"]
    log(f"[{label}] warming up {url} ({name})")
    asyncio.run(run_level(url, name, 2, 4, prompt_words, 4, chat, seed=999))
    levels = []
    for c in concurrency:
        n = num_requests or max(16, 2 * c)
        runs = []
        for r in range(repeats):
            lv = asyncio.run(run_level(url, name, c, n, prompt_words, max_tokens, chat, seed=c * 100 + r))
            log(f"[{label}] {c} streams, run {r + 1}/{repeats}: ttft p50 {lv['ttft_p50_ms']:.1f} ms "
                f"(engine {lv['engine_ttft_p50_ms']:.1f}), overhead p50 {lv['overhead_p50_ms']:.2f} ms, "
                f"itl p50 {lv['itl_p50_ms']:.1f} ms, {lv['throughput_tok_s']:.0f} tok/s, errors {lv['errors']}")
            runs.append(lv)
        levels.append(_median_runs(runs))
    return name, levels


def run_serve_bench(*, url: str | None, model_dir: str | None, model: str | None, concurrency: list[int],
                    num_requests: int | None, prompt_words: int, max_tokens: int, chat: bool, repeats: int,
                    json_out: str | None, docs_out: str | None, engines: list[str] | None = None,
                    server_args: list[str] | None = None) -> dict:
    """Sweep concurrency against ``url``, or against ``sits serve --model model_dir`` once per engine mode."""
    modes: dict[str, list[dict]] = {}
    if url is not None:
        name, modes["server"] = sweep(url, model, concurrency, num_requests, prompt_words, max_tokens, chat,
                                      repeats, "server")
    else:
        if model_dir is None:
            raise ValueError("give --url of a running server or --model DIR to start one")
        for mode in engines or ["process"]:
            proc, mode_url = start_sits(["serve", "--model", model_dir, "--engine", mode, *(server_args or [])])
            try:
                name, modes[mode] = sweep(mode_url, model, concurrency, num_requests, prompt_words, max_tokens,
                                          chat, repeats, mode)
            finally:
                stop_sits(proc)
    result = {"url": url, "model": model_dir or name, "endpoint": "/v1/chat/completions" if chat else "/v1/completions",
              "prompt_words": prompt_words, "max_tokens": max_tokens, "repeats": repeats, "modes": modes,
              "host": f"{os.cpu_count()} CPU cores, client and server on the same host"}
    command = bench_command("serve")
    write_json(json_out, result)
    if docs_out:
        docs = Path(docs_out)
        plot_path = docs.parent / "img" / "serve_bench.png"
        _plot(modes, plot_path)
        write_docs(docs, _markdown(result, command, os.path.relpath(plot_path, docs.parent)), DOC_BEGIN, DOC_END)
    return result
