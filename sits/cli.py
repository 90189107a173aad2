"""The ``sits`` command: build offline models, generate from a model directory, run benchmarks."""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import time

from sits.engine.errors import SitsError


def _add_engine_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", required=True, help="local Hugging Face model directory")
    p.add_argument("--device", default="auto", help="cpu, cuda, cuda:N or auto (default)")
    p.add_argument("--dtype", default="float32", help="float32 (default), bfloat16, float16")
    p.add_argument("--threads", type=int, default=None, help="CPU intra-op threads (default: all cores)")
    p.add_argument("--policy", default="pfsd", choices=["pfsd", "fcfs"], help="scheduler policy")
    p.add_argument("--kv-cache-mb", type=int, default=512, help="KV pool size in MiB")
    p.add_argument("--no-warmup", action="store_true", help="skip multi-level warm-up")


def _engine_config(args: argparse.Namespace):
    from sits.engine.config import EngineConfig
    return EngineConfig(model=args.model, device=args.device, dtype=args.dtype, threads=args.threads,
                        policy=args.policy, kv_cache_memory_mb=args.kv_cache_mb, warmup=not args.no_warmup)


def cmd_build_tiny(args: argparse.Namespace) -> int:
    from sits.engine.models.tiny import build_tiny_model
    build_tiny_model(args.dir, preset=args.preset, seed=args.seed, train_seconds=args.train_seconds,
                     overwrite=args.overwrite, progress=lambda m: print(m, file=sys.stderr, flush=True))
    print(args.dir)
    return 0


def cmd_generate(args: argparse.Namespace) -> int:
    from sits.engine.async_engine import AsyncEngine
    from sits.engine.sampling_params import SamplingParams

    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                            top_k=args.top_k, seed=args.seed, stop=args.stop or [])

    async def run() -> None:
        print(f"loading {args.model} ...", file=sys.stderr, flush=True)
        engine = await AsyncEngine.start(_engine_config(args))
        t0 = time.monotonic()
        first = None
        n = 0
        reason = None
        sys.stdout.write(args.prompt)
        async for ev in engine.generate(args.prompt, params):
            if first is None:
                first = time.monotonic() - t0
            n += 1
            reason = ev.finish_reason
            sys.stdout.write(ev.text)
            sys.stdout.flush()
        total = time.monotonic() - t0
        sys.stdout.write("\n")
        print(engine.engine.report.format(), file=sys.stderr)
        print(f"{n} tokens, finish_reason={reason}, ttft {first * 1e3:.1f} ms, "
              f"{n / total:.1f} tok/s", file=sys.stderr)
        await engine.shutdown()

    asyncio.run(run())
    return 0


def _api_keys(args: argparse.Namespace) -> tuple[str, ...]:
    keys = list(args.api_key or [])
    if args.api_keys_file:
        with open(args.api_keys_file, encoding="utf-8") as f:
            keys += [ln.strip() for ln in f if ln.strip() and not ln.lstrip().startswith("#")]
    if not keys and os.environ.get("SITS_API_KEY"):
        keys.append(os.environ["SITS_API_KEY"])
    return tuple(keys)


def cmd_serve(args: argparse.Namespace) -> int:
    from sits.api.context import ServerSettings
    from sits.api.server import serve
    settings = ServerSettings(api_keys=_api_keys(args), max_body_bytes=args.max_body_bytes,
                              webhook_secret=args.webhook_secret or os.environ.get("SITS_WEBHOOK_SECRET"),
                              request_retention_s=args.request_retention_s, drain_grace_s=args.drain_grace_s)
    cfg = _engine_config(args)
    if args.max_model_len:
        cfg.max_model_len = args.max_model_len
    return serve(cfg, settings, host=args.host, port=args.port, served_name=args.served_model_name,
                 log_level=args.log_level, engine_mode=args.engine)


def cmd_bench_engine(args: argparse.Namespace) -> int:
    from sits.bench.engine_bench import run_engine_bench
    result = run_engine_bench(args.model, json_out=args.json, docs_out=args.write_docs, quick=args.quick,
                              only=args.only, threads=args.threads, repeats=args.repeats)
    print(json.dumps(result["summary"], indent=2))
    return 0


def cmd_bench_serve(args: argparse.Namespace) -> int:
    from sits.bench.serve_bench import run_serve_bench
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
                             docs_out=args.write_docs, engines=args.engine.split(","), server_args=server_args)
    levels = [lv for lvs in result["modes"].values() for lv in lvs]
    print(json.dumps({mode: [{k: (round(v, 2) if isinstance(v, float) else v) for k, v in lv.items()
                              if k != "error_samples"} for lv in lvs] for mode, lvs in result["modes"].items()},
                     indent=2))
    return 1 if any(lv["errors"] for lv in levels) else 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="sits", description="SITS: a serverless runtime for LLM inference")
    sub = parser.add_subparsers(dest="command", required=True)

    model = sub.add_parser("model", help="model utilities").add_subparsers(dest="model_command", required=True)
    bt = model.add_parser("build-tiny", help="write an offline Llama model directory with random weights")
    bt.add_argument("dir")
    bt.add_argument("--preset", default="tiny", choices=["tiny", "small", "base"])
    bt.add_argument("--seed", type=int, default=0)
    bt.add_argument("--train-seconds", type=float, default=0.0,
                    help="train briefly on offline text so output reads like text")
    bt.add_argument("--overwrite", action="store_true")
    bt.set_defaults(func=cmd_build_tiny)

    gen = sub.add_parser("generate", help="stream a completion to the terminal")
    _add_engine_args(gen)
    gen.add_argument("prompt")
    gen.add_argument("--max-tokens", type=int, default=64)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--top-k", type=int, default=0)
    gen.add_argument("--seed", type=int, default=None)
    gen.add_argument("--stop", action="append", help="stop string (repeatable)")
    gen.set_defaults(func=cmd_generate)

    srv = sub.add_parser("serve", help="serve one model over HTTP (OpenAI + SITS dialects)")
    _add_engine_args(srv)
    srv.add_argument("--host", default="127.0.0.1")
    srv.add_argument("--port", type=int, default=8000)
    srv.add_argument("--served-model-name", default=None, help="the model name clients send (default: dir name)")
    srv.add_argument("--max-model-len", type=int, default=None, help="cap the context length")
    srv.add_argument("--api-key", action="append", help="accepted Bearer key (repeatable; env SITS_API_KEY)")
    srv.add_argument("--api-keys-file", default=None, help="file with one accepted key per line")
    srv.add_argument("--max-body-bytes", type=int, default=1 << 20, help="larger request bodies get 413")
    srv.add_argument("--webhook-secret", default=None, help="sign webhook POSTs (env SITS_WEBHOOK_SECRET)")
    srv.add_argument("--request-retention-s", type=float, default=600.0,
                     help="how long finished /v1/requests stay readable")
    srv.add_argument("--drain-grace-s", type=float, default=10.0,
                     help="on shutdown, in-flight streams get this long to finish")
    srv.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    srv.add_argument("--engine", default="process", choices=["process", "thread"],
                     help="run the engine in its own process (default) or in a thread of the server")
    srv.set_defaults(func=cmd_serve)

    bench = sub.add_parser("bench", help="benchmarks").add_subparsers(dest="bench_command", required=True)
    be = bench.add_parser("engine", help="engine benchmarks: bursty fcfs vs pfsd, decode vs HF, prefix cache")
    be.add_argument("--model", required=True)
    be.add_argument("--json", default=None, help="write results JSON here")
    be.add_argument("--write-docs", default=None, help="append a results section to this markdown file")
    be.add_argument("--quick", action="store_true", help="smaller workload (smoke run)")
    be.add_argument("--only", choices=["bursty", "decode", "prefix"], action="append")
    be.add_argument("--threads", type=int, default=None)
    be.add_argument("--repeats", type=int, default=None, help="runs per figure, median reported (default 3; 1 with --quick)")
    be.set_defaults(func=cmd_bench_engine)
    bs = bench.add_parser("serve", help="concurrent streaming clients over HTTP; TTFT/ITL/e2e and server overhead")
    where = bs.add_mutually_exclusive_group(required=True)
    where.add_argument("--url", help="a running server (e.g. http://127.0.0.1:8000)")
    where.add_argument("--model", help="model directory: start `sits serve` on it for the run")
    bs.add_argument("--served-model", default=None, help="model name to request (default: the first served)")
    bs.add_argument("--concurrency", default="1,4,16,64", help="comma-separated stream counts")
    bs.add_argument("--requests", type=int, default=None, help="requests per level (default max(16, 2*C))")
    bs.add_argument("--prompt-words", type=int, default=48)
    bs.add_argument("--max-tokens", type=int, default=32)
    bs.add_argument("--completions", action="store_true", help="use /v1/completions instead of chat")
    bs.add_argument("--repeats", type=int, default=None, help="runs per level, median reported (default 3)")
    bs.add_argument("--threads", type=int, default=None, help="server CPU threads (with --model)")
    bs.add_argument("--engine", default="process,thread",
                    help="with --model: engine modes to sweep, comma-separated (default process,thread: an A/B)")
    bs.add_argument("--quick", action="store_true", help="levels 1 and 8, one run (smoke)")
    bs.add_argument("--json", default=None)
    bs.add_argument("--write-docs", default=None)
    bs.set_defaults(func=cmd_bench_serve)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except SitsError as e:
        print(f"error [{e.code}]: {e.message}", file=sys.stderr)
        return 2
    except FileExistsError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
