"""The ``sits`` command: build offline models, generate from a model directory, run benchmarks."""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import time

from sits.engine.errors import SitsError


DEFAULT_URL = "http://127.0.0.1:8000"


class _DefaultsFormatter(argparse.HelpFormatter):
    """Every option's help ends with its default, unless the help already says it or there is none."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if ("default" in text or not action.option_strings or action.default is None
                or action.default is False or action.default == [] or action.default == argparse.SUPPRESS):
            return text
        return text + " (default: %(default)s)"


class _Parser(argparse.ArgumentParser):
    """The ``sits`` parser; its subcommand parsers are of this class too, so all share the formatter."""

    def __init__(self, *args, **kw):
        kw.setdefault("formatter_class", _DefaultsFormatter)
        super().__init__(*args, **kw)


def _add_engine_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", required=True, help="local Hugging Face model directory")
    p.add_argument("--device", default="auto", help="cpu, cuda, cuda:N or auto")
    p.add_argument("--dtype", default="float32", help="weights and KV cache: float32, bfloat16 or float16")
    p.add_argument("--threads", type=int, default=None, help="CPU intra-op threads (default: all cores)")
    p.add_argument("--policy", default="pfsd", choices=["pfsd", "fcfs"], help="scheduler policy")
    p.add_argument("--kv-cache-mb", type=int, default=512, help="KV pool size, MiB")
    p.add_argument("--no-warmup", action="store_true", help="skip multi-level warm-up")


def _port(text: str) -> int:
    if not text.isdigit() or int(text) > 65535:
        raise argparse.ArgumentTypeError(f"{text!r} is not a TCP port (0-65535)")
    return int(text)


def _add_http_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--host", default="127.0.0.1", help="address to listen on")
    p.add_argument("--port", type=_port, default=8000, help="TCP port to listen on")
    p.add_argument("--api-key", action="append",
                   help="accepted Bearer key (repeatable; default: $SITS_API_KEY, else no key needed)")
    p.add_argument("--api-keys-file", default=None, help="file with one accepted key per line")
    p.add_argument("--max-body-bytes", type=int, default=1 << 20, help="request bodies over this many bytes get 413")
    p.add_argument("--webhook-secret", default=None,
                   help="sign webhook POSTs with this key (default: $SITS_WEBHOOK_SECRET, else unsigned)")
    p.add_argument("--request-retention-s", type=float, default=600.0,
                   help="how long finished /v1/requests stay readable, seconds")
    p.add_argument("--drain-grace-s", type=float, default=10.0,
                   help="on shutdown, in-flight streams get this long to finish, seconds")
    p.add_argument("--admin-key", action="append",
                   help="Bearer key for the /admin endpoints, e.g. fault injection (repeatable; default: "
                        "$SITS_ADMIN_KEY, else the endpoints are off)")
    p.add_argument("--allow-private-callbacks", action="store_true",
                   help="let callback_url point at loopback / private addresses (refused by default)")
    p.add_argument("--tools-dir", action="append", default=[],
                   help="a directory of tool contracts (*.yaml) beside the built-ins (repeatable)")
    p.add_argument("--session-store", default=None,
                   help="where X-Session-ID conversations live: redis://host:port/db, sqlite:///path, or none "
                        "(default: SQLite in --data-dir)")
    p.add_argument("--trace-exporter", default=None, choices=["none", "console", "otlp", "memory"],
                   help="OpenTelemetry spans (default: otlp when OTEL_EXPORTER_OTLP_ENDPOINT is set, else none; "
                        "memory keeps recent traces for GET /admin/traces)")
    p.add_argument("--otel-metrics", default=None, choices=["none", "console", "otlp", "memory"],
                   help="OpenTelemetry GenAI metrics beside /metrics (default: otlp when the OTLP endpoint is set, "
                        "else none)")
    p.add_argument("--no-hot-path", action="store_true",
                   help="route the generation endpoints through FastAPI's router too (the baseline of "
                        "`sits bench serve --baseline-args`)")
    p.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"],
                   help="server log verbosity")


def _add_client_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--url", default=None, help=f"the SITS gateway (default: $SITS_URL, else {DEFAULT_URL})")
    p.add_argument("--api-key", default=None, help="Bearer key (default: $SITS_API_KEY, else none)")
    p.add_argument("--timeout", type=float, default=600.0, help="how long to wait for the gateway's answer, seconds")


def _gateway_url(args: argparse.Namespace) -> str:
    """--url, else $SITS_URL as it is when the command runs, else the default."""
    return args.url or os.environ.get("SITS_URL") or DEFAULT_URL


def _add_bench_output_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--json", default=None, help="write the results as JSON to this file")
    p.add_argument("--write-docs", default=None,
                   help="put the results section in this markdown file (replacing its previous one)")


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
    from sits.api.server import serve
    settings = _server_settings(args)
    cfg = _engine_config(args)
    if args.max_model_len:
        cfg.max_model_len = args.max_model_len
    return serve(cfg, settings, host=args.host, port=args.port, served_name=args.served_model_name,
                 log_level=args.log_level, engine_mode=args.engine)


def _server_settings(args: argparse.Namespace):
    from sits.api.context import ServerSettings
    return ServerSettings(api_keys=_api_keys(args), max_body_bytes=args.max_body_bytes,
                          webhook_secret=args.webhook_secret or os.environ.get("SITS_WEBHOOK_SECRET"),
                          request_retention_s=args.request_retention_s, drain_grace_s=args.drain_grace_s,
                          admin_keys=tuple(args.admin_key or ([os.environ["SITS_ADMIN_KEY"]]
                                                              if os.environ.get("SITS_ADMIN_KEY") else [])),
                          allow_private_callbacks=args.allow_private_callbacks,
                          trace_exporter=args.trace_exporter, otel_metrics=args.otel_metrics,
                          session_store=args.session_store, data_dir=args.data_dir,
                          tool_dirs=tuple(args.tools_dir), hot_path=not args.no_hot_path)


def cmd_up(args: argparse.Namespace) -> int:
    from sits.api.gateway_server import up
    from sits.runtime.unit_spec import load_runtime_config
    config = args.config
    if config is None and os.path.exists("sits.yaml"):
        config = "sits.yaml"
    units = load_runtime_config(config).units if config else []
    return up(units, _server_settings(args), data_dir=args.data_dir, host=args.host, port=args.port,
              log_level=args.log_level, prefetch=not args.no_prefetch)


def _control(args: argparse.Namespace, method: str, path: str, body=None):
    import httpx
    url = _gateway_url(args)
    key = args.api_key or os.environ.get("SITS_API_KEY")
    headers = {"authorization": f"Bearer {key}"} if key else {}
    try:
        r = httpx.request(method, url.rstrip("/") + path, json=body, headers=headers, timeout=args.timeout)
    except (httpx.HTTPError, httpx.InvalidURL) as e:
        raise SitsError(f"cannot reach the SITS gateway at {url} (set --url or SITS_URL): {e}",
                        code="gateway_unreachable") from None
    data = r.json() if r.headers.get("content-type", "").startswith("application/json") else {}
    if r.status_code >= 400:
        err = data.get("error") or {}
        raise SitsError(err.get("message") or f"HTTP {r.status_code}", code=err.get("code") or "http_error")
    return data


def _instances_summary(u: dict) -> str:
    counts: dict[str, int] = {}
    for i in u["instances"]:
        counts[i["state"]] = counts.get(i["state"], 0) + 1
    return ", ".join(f"{n} {st}" for st, n in counts.items()) or "0"


def cmd_iu(args: argparse.Namespace) -> int:
    from sits.runtime.unit_spec import load_unit_file
    if args.iu_command == "deploy":
        spec = load_unit_file(args.file)
        u = _control(args, "POST", "/v1/units", spec.model_dump())
        print(f"deployed {u['name']} ({u['model']}); instances: {_instances_summary(u)}, desired {u['desired']}")
    elif args.iu_command == "list":
        for u in _control(args, "GET", "/v1/units")["data"]:
            sc = u["spec"]["scale"]
            print(f"{u['name']:<20} instances {_instances_summary(u):<20} desired {u['desired']} "
                  f"(min {sc['min_instances']}, max {sc['max_instances']})  model {u['model']}")
    elif args.iu_command == "delete":
        _control(args, "DELETE", f"/v1/units/{args.name}")
        print(f"deleted {args.name}")
    elif args.iu_command == "scale":
        u = _control(args, "POST", f"/v1/units/{args.name}/scale", {"instances": args.instances})
        print(f"{u['name']}: desired {u['desired']}; instances: {_instances_summary(u)}")
    return 0


def _fmt(v, spec: str = ".0f", unit: str = "") -> str:
    return "-" if v is None else f"{v:{spec}}{unit}"


def cmd_tool_list(args: argparse.Namespace) -> int:
    from sits.tools import ToolRegistry
    for c in ToolRegistry(args.tools_dir or []).all():
        print(f"{c.ref:<24} {c.runtime:<6} {c.timeout_ms:>6} ms  {', '.join(c.side_effects):<32} {c.description}")
    return 0


def cmd_tool_run(args: argparse.Namespace) -> int:
    """Run one tool call in the sandbox, as a unit would (e.g. to try a new contract)."""
    from sits.tools import ToolError, ToolRegistry, run_tool
    try:
        call_args = json.loads(args.arguments)
    except json.JSONDecodeError as e:
        print(f"arguments are not JSON: {e}", file=sys.stderr)
        return 2
    dirs = dict(d.split("=", 1) for d in args.dir or [])
    try:
        contract = ToolRegistry(args.tools_dir or []).resolve(args.ref)
        r = run_tool(contract, call_args, dirs=dirs, python_allowed=args.allow_python)
    except ToolError as e:
        print(f"{e.code}: {e.message}", file=sys.stderr)
        return 1
    sys.stdout.write(r.output)
    print(f"[{r.ref}: {r.elapsed_ms:.1f} ms, fuel {r.fuel_used}]", file=sys.stderr)
    return 0


def cmd_status(args: argparse.Namespace) -> int:
    st = _control(args, "GET", "/v1/status")
    if args.json:
        print(json.dumps(st, indent=2))
        return 0
    print(f"{'unit':<16} {'desired':>7}  {'instances':<22} {'waiting':>7} {'ttft p95':>9} {'itl p95':>8} "
          f"{'rps':>6} {'health':>6}  cold start  last decision")
    for u in st["units"]:
        m, d = u["metrics"], u["last_decision"] or {}
        cold = u["cold_start"].get("total_ms")
        print(f"{u['name']:<16} {u['desired']:>7}  {_instances_summary(u):<22} {u['waiting']:>7} "
              f"{_fmt(m['ttft_p95_ms'], '.0f', 'ms'):>9} {_fmt(m['itl_p95_ms'], '.0f', 'ms'):>8} {m['rps']:>6.2f} "
              f"{_fmt(u['slo_health'], '.2f'):>6}  {_fmt(cold, '.0f', ' ms'):>10}  {d.get('reason', '-')}")
        phases = u["cold_start"].get("phases_ms") or {}
        if phases:
            print("    last cold start: " + ", ".join(f"{k} {v:.0f}ms" for k, v in phases.items()))
        quotas = {i["cpu_quota"]["mechanism"] + (f" {i['cpu_quota']['cpus']:g} cpu" if i["cpu_quota"]["cpus"] else "")
                  for i in u["instances"] if i.get("cpu_quota")}
        if quotas:
            print("    cpu quota: " + ", ".join(sorted(quotas)))
        if (f := u.get("start_failure")):
            print(f"    FAILING TO START ({f['failures_in_a_row']} in a row, next try in {f['retry_in_s']:.1f}s): "
                  f"{f['error']}")
    print()
    print(f"{'SLA':<16} {'ttft slo':>9} {'target':>7} {'attained':>9} {'in window':>9}  {'breaker':<9} {'trips':>5} "
          f"{'shed':>5}  fallback")
    for u in st["units"]:
        s = u.get("sla") or {}
        if not s:
            continue
        print(f"{u['name']:<16} {_fmt(s['ttft_slo_ms'], '.0f', 'ms'):>9} {s['success_rate_target']:>7.2f} "
              f"{_fmt(s['attainment'], '.2f'):>9} {s['requests_in_window']:>9}  {s['state']:<9} {s['trips']:>5} "
              f"{s['rejected']:>5}  {s.get('fallback') or '-'}")
    return 0


def cmd_bench_engine(args: argparse.Namespace) -> int:
    from sits.bench.engine_bench import run_engine_bench
    result = run_engine_bench(args.model, json_out=args.json, docs_out=args.write_docs, quick=args.quick,
                              only=args.only, threads=args.threads, repeats=args.repeats, device=args.device,
                              dtype=args.dtype)
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
                             docs_out=args.write_docs, engines=args.engine.split(","), server_args=server_args,
                             baseline_args=args.baseline_args.split() if args.baseline_args else None,
                             baseline_code=args.baseline_code)
    levels = [lv for lvs in result["modes"].values() for lv in lvs]
    print(json.dumps({mode: [{k: (round(v, 2) if isinstance(v, float) else v) for k, v in lv.items()
                              if k != "error_samples"} for lv in lvs] for mode, lvs in result["modes"].items()},
                     indent=2))
    return 1 if any(lv["errors"] for lv in levels) else 0


def cmd_bench_tracing(args: argparse.Namespace) -> int:
    from sits.bench.tracing_bench import run_tracing_bench
    r = run_tracing_bench(args.model, concurrency=[int(c) for c in args.concurrency.split(",")],
                          repeats=args.repeats, rounds=args.rounds, json_out=args.json, docs_out=args.write_docs,
                          engine=args.engine)
    print(json.dumps(r["table"], indent=2))
    return 0


def cmd_bench_guided(args: argparse.Namespace) -> int:
    from sits.bench.guided_bench import run_guided_bench
    r = run_guided_bench(args.model, concurrency=args.concurrency, rounds=args.rounds, max_tokens=args.max_tokens,
                         threads=args.threads, json_out=args.json, docs_out=args.write_docs)
    print(json.dumps({k: (round(v, 3) if isinstance(v, float) else v) for k, v in r.items()}, indent=2))
    return 0


def cmd_bench_coldstart(args: argparse.Namespace) -> int:
    from sits.bench.coldstart_bench import run_coldstart_bench
    r = run_coldstart_bench(args.model, repeats=args.repeats, json_out=args.json, docs_out=args.write_docs,
                            threads=args.threads, skip_naive=args.skip_naive, warmup=args.warmup)
    print(json.dumps({k: (round(v, 3) if isinstance(v, float) else v) for k, v in r.items()
                      if not k.endswith("_runs_ms")}, indent=2))
    return 0


def cmd_bench_prefetch(args: argparse.Namespace) -> int:
    from sits.bench.prefetch_bench import run_prefetch_bench
    r = run_prefetch_bench(args.model, train=args.train, repeats=args.repeats, a_tokens=args.a_tokens,
                           json_out=args.json, docs_out=args.write_docs)
    print(json.dumps({k: v for k, v in r.items() if not k.endswith("_runs_ms")}, indent=2))
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="sits", description="SITS: a serverless runtime for LLM inference")
    sub = parser.add_subparsers(dest="command", required=True)

    model = sub.add_parser("model", help="model utilities").add_subparsers(dest="model_command", required=True)
    bt = model.add_parser("build-tiny", help="write an offline Llama model directory with random weights")
    bt.add_argument("dir", help="the model directory to write")
    bt.add_argument("--preset", default="tiny", choices=["tiny", "small", "base"],
                    help="size: tiny ~5M, small ~25M, base ~110M parameters")
    bt.add_argument("--seed", type=int, default=0, help="seed of the random weights")
    bt.add_argument("--train-seconds", type=float, default=0.0,
                    help="train briefly on offline text so output reads like text, seconds")
    bt.add_argument("--overwrite", action="store_true", help="replace a model already in the directory")
    bt.set_defaults(func=cmd_build_tiny)

    gen = sub.add_parser("generate", help="stream a completion to the terminal")
    _add_engine_args(gen)
    gen.add_argument("prompt", help="the text to continue")
    gen.add_argument("--max-tokens", type=int, default=64, help="tokens to generate at most")
    gen.add_argument("--temperature", type=float, default=0.0, help="sampling temperature; 0 is greedy")
    gen.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling: keep this probability mass")
    gen.add_argument("--top-k", type=int, default=0, help="sample among the k likeliest tokens; 0 is off")
    gen.add_argument("--seed", type=int, default=None, help="sampling seed (default: none, a fresh one each run)")
    gen.add_argument("--stop", action="append", help="stop string (repeatable)")
    gen.set_defaults(func=cmd_generate)

    srv = sub.add_parser("serve", help="serve one model over HTTP (OpenAI + SITS dialects)")
    _add_engine_args(srv)
    _add_http_args(srv)
    srv.add_argument("--served-model-name", default=None, help="the model name clients send (default: dir name)")
    srv.add_argument("--max-model-len", type=int, default=None,
                     help="cap the context length, tokens (default: the model's)")
    srv.add_argument("--engine", default="process", choices=["process", "thread"],
                     help="run the engine in its own process or in a thread of the server")
    srv.add_argument("--data-dir", default=os.environ.get("SITS_DATA_DIR", ".sits"),
                     help="embedded state: sessions.db (default: $SITS_DATA_DIR, else .sits)")
    srv.set_defaults(func=cmd_serve)

    upp = sub.add_parser("up", help="start the gateway with its units (the serverless runtime)")
    upp.add_argument("--config", default=None, help="YAML with `units: [...]` (default: ./sits.yaml if present)")
    upp.add_argument("--data-dir", default=os.environ.get("SITS_DATA_DIR", ".sits"),
                     help="where the deployed units and sessions are kept (default: $SITS_DATA_DIR, else .sits)")
    upp.add_argument("--no-prefetch", action="store_true", help="turn trace-driven pre-warming off")
    _add_http_args(upp)
    upp.set_defaults(func=cmd_up)

    iu = sub.add_parser("iu", help="manage the units of a running gateway").add_subparsers(dest="iu_command",
                                                                                         required=True)
    dep = iu.add_parser("deploy", help="deploy (or replace) a unit from its YAML file")
    dep.add_argument("--file", required=True, help="the unit's YAML file")
    iu.add_parser("list", help="deployed units and their instances")
    de = iu.add_parser("delete", help="delete a unit (its instances drain and stop)")
    de.add_argument("name", help="the unit")
    scl = iu.add_parser("scale", help="set a unit's instance count now (the autoscaler carries on from there)")
    scl.add_argument("name", help="the unit")
    scl.add_argument("instances", type=int, help="instances wanted now")
    for p in iu.choices.values():
        _add_client_args(p)
        p.set_defaults(func=cmd_iu)
    tool = sub.add_parser("tool", help="tool contracts and the WASM sandbox").add_subparsers(dest="tool_cmd",
                                                                                          required=True)
    tl = tool.add_parser("list", help="the known contracts (built-ins and --tools-dir)")
    tl.add_argument("--tools-dir", action="append", help="a directory of *.yaml contracts (repeatable)")
    tl.set_defaults(func=cmd_tool_list)
    tr = tool.add_parser("run", help="run one call: sits tool run 'math.eval@^1' '{\"expression\": \"6*7\"}'")
    tr.add_argument("ref", help="id@constraint, e.g. file.read@^1.2")
    tr.add_argument("arguments", help="the call's arguments as JSON")
    tr.add_argument("--dir", action="append", help="GUEST=HOST: the host directory behind a declared one")
    tr.add_argument("--tools-dir", action="append", help="a directory of *.yaml contracts (repeatable)")
    tr.add_argument("--allow-python", action="store_true", help="allow runtime: python tools")
    tr.set_defaults(func=cmd_tool_run)

    stp = sub.add_parser("status", help="units, instances, SLO health, cold starts and scaling decisions")
    stp.add_argument("--json", action="store_true", help="print the gateway's /v1/status JSON instead of tables")
    _add_client_args(stp)
    stp.set_defaults(func=cmd_status)

    bench = sub.add_parser("bench", help="benchmarks").add_subparsers(dest="bench_command", required=True)
    be = bench.add_parser("engine", help="engine benchmarks: bursty fcfs vs pfsd, decode vs HF, prefix cache")
    be.add_argument("--model", required=True, help="local Hugging Face model directory")
    _add_bench_output_args(be)
    be.add_argument("--quick", action="store_true", help="smaller workload (smoke run)")
    be.add_argument("--only", choices=["bursty", "decode", "prefix"], action="append",
                    help="run only this part (repeatable; default: all three)")
    be.add_argument("--threads", type=int, default=None,
                    help="CPU threads, for the engine and the HF baseline alike (default: all cores)")
    be.add_argument("--device", default="cpu", help="cpu, cuda, cuda:N or auto: the engine and the HF baseline alike")
    be.add_argument("--dtype", default="float32", help="weights and KV cache, for both (float32, bfloat16, float16)")
    be.add_argument("--repeats", type=int, default=None,
                    help="runs per figure, median reported (default: 3; 1 with --quick)")
    be.set_defaults(func=cmd_bench_engine)
    bc = bench.add_parser("coldstart", help="no instance -> first token: naive transformers vs SITS cold vs warm")
    bc.add_argument("--model", required=True, help="local Hugging Face model directory")
    bc.add_argument("--repeats", type=int, default=5, help="starts measured per variant, median reported")
    bc.add_argument("--threads", type=int, default=None, help="CPU threads per instance (default: all cores)")
    bc.add_argument("--warmup", default="all", choices=["all", "minimal", "false"], help="the unit's warm-up")
    bc.add_argument("--skip-naive", action="store_true", help="SITS cold/warm only (no transformers baseline)")
    _add_bench_output_args(bc)
    bc.set_defaults(func=cmd_bench_coldstart)
    btr = bench.add_parser("tracing", help="served TTFT with spans off vs every span recorded (same run)")
    btr.add_argument("--model", required=True, help="local Hugging Face model directory")
    btr.add_argument("--concurrency", default="1,8", help="comma-separated stream counts")
    btr.add_argument("--repeats", type=int, default=2, help="runs per level and round")
    btr.add_argument("--rounds", type=int, default=2, help="off/on alternations (a fresh pair of servers each)")
    btr.add_argument("--engine", default="process", choices=["process", "thread"], help="the servers' engine mode")
    _add_bench_output_args(btr)
    btr.set_defaults(func=cmd_bench_tracing)
    bg = bench.add_parser("guided", help="tool-call grammar: mask overhead vs free decoding, jump-forward on vs off")
    bg.add_argument("--model", required=True, help="local Hugging Face model directory")
    bg.add_argument("--concurrency", type=int, default=8, help="tool-call requests run together")
    bg.add_argument("--rounds", type=int, default=3, help="rounds of each variant, median reported")
    bg.add_argument("--max-tokens", type=int, default=96, help="tokens per request at most")
    bg.add_argument("--threads", type=int, default=None, help="CPU threads (default: all cores)")
    _add_bench_output_args(bg)
    bg.set_defaults(func=cmd_bench_guided)
    bp = bench.add_parser("prefetch", help="two-unit chain: TTFT of the second call with pre-warming on vs off")
    bp.add_argument("--model", required=True, help="local Hugging Face model directory")
    bp.add_argument("--train", type=int, default=6, help="chains run first so the gateway learns the chain")
    bp.add_argument("--repeats", type=int, default=5, help="chains measured, median reported")
    bp.add_argument("--a-tokens", type=int, default=32, help="tokens the first call streams")
    _add_bench_output_args(bp)
    bp.set_defaults(func=cmd_bench_prefetch)
    bs = bench.add_parser("serve", help="concurrent streaming clients over HTTP; TTFT/ITL/e2e and server overhead")
    where = bs.add_mutually_exclusive_group(required=True)
    where.add_argument("--url", help="a running server (e.g. http://127.0.0.1:8000)")
    where.add_argument("--model", help="model directory: start `sits serve` on it for the run")
    bs.add_argument("--served-model", default=None, help="model name to request (default: the first served)")
    bs.add_argument("--concurrency", default="1,4,16,64", help="comma-separated stream counts")
    bs.add_argument("--requests", type=int, default=None, help="requests per level (default: max(16, 2*C))")
    bs.add_argument("--prompt-words", type=int, default=48, help="words per prompt")
    bs.add_argument("--max-tokens", type=int, default=32, help="tokens per response at most")
    bs.add_argument("--completions", action="store_true", help="use /v1/completions instead of chat")
    bs.add_argument("--repeats", type=int, default=None, help="runs per level, median reported (default: 3)")
    bs.add_argument("--threads", type=int, default=None, help="server CPU threads, with --model (default: all cores)")
    bs.add_argument("--engine", default="process,thread",
                    help="with --model: engine modes to sweep, comma-separated (two: an A/B)")
    bs.add_argument("--baseline-args", default=None,
                    help="with --model: per engine mode, also a server with these arguments (e.g. --no-hot-path), "
                         "measured in the same run, runs alternating; reported as ratios")
    bs.add_argument("--baseline-code", default=None, metavar="CHECKOUT",
                    help="with --model: per engine mode, also a server running the sits package of another checkout "
                         "(e.g. `git worktree add /tmp/old HEAD~1`): old vs new code in the same run")
    bs.add_argument("--quick", action="store_true", help="levels 1 and 8, one run (smoke)")
    _add_bench_output_args(bs)
    bs.set_defaults(func=cmd_bench_serve)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except SitsError as e:
        print(f"sits: error [{e.code}]: {e.message}", file=sys.stderr)
        return 2
    except FileExistsError as e:          # build-tiny: the message says to pass --overwrite
        print(f"sits: error: {e}", file=sys.stderr)
        return 2
    except OSError as e:
        if e.filename is None:            # not a file the user named: a bug, keep its traceback
            raise
        print(f"sits: error: {e.filename}: {e.strerror}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
