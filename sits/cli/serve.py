"""``sits generate``, ``sits serve`` and ``sits up``: the commands that run models."""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import time


def _add_engine_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", required=True, help="local Hugging Face model directory")
    p.add_argument("--device", default="auto", help="cpu, cuda, cuda:N or auto")
    p.add_argument("--dtype", default="auto",
                   help="weights and KV cache: auto (follow the checkpoint: bf16 where this device computes it "
                        "natively, else fp32), float32, bfloat16 or float16 (default: auto)")
    p.add_argument("--gguf-weights", default="auto", choices=["auto", "blocks", "dequantize"],
                   help="a GGUF's block-quantized weights (Q4_0 to Q8_0, Q4_K, Q5_K, Q6_K): served as the file's "
                        "blocks (fp32 on a CPU), or dequantized at load; auto: blocks where usable")
    p.add_argument("--block-activations", default="fp32", choices=["fp32", "int8"],
                   help="what those blocks multiply in a step of up to 32 rows (decodes, short prefills): "
                        "fp32 activations (the dequantized model's sums, to rounding) or int8 (quantized per "
                        "block, integer dot products, as llama.cpp: faster, approximate) (default: fp32)")
    p.add_argument("--quantization", default=None, choices=["int8"],
                   help="quantize the projections' weights at load: int8 (per-channel, weight-only; half the "
                        "memory of bf16) (default: none)")
    p.add_argument("--threads", type=int, default=None, help="CPU intra-op threads (default: all cores)")
    p.add_argument("--policy", default="pfsd", choices=["pfsd", "fcfs"], help="scheduler policy")
    p.add_argument("--kv-cache-mb", type=int, default=512, help="KV pool size, MiB (on a CPU, or a GPU given "
                   "--gpu-memory-utilization 0)")
    p.add_argument("--gpu-memory-utilization", type=float, default=0.9,
                   help="on a GPU: the share of its memory the engine may fill; the KV pool takes what is free of "
                        "it after the weights (0: use --kv-cache-mb)")
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
    p.add_argument("--tenant-store", default=None,
                   help="where tenants, keys, usage and the budgets' running state live: redis://host:port/db "
                        "lets several gateways share them (default: SQLite in --data-dir, one gateway)")
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


def _engine_config(args: argparse.Namespace):
    from sits.engine.config import EngineConfig
    return EngineConfig(model=args.model, device=args.device, dtype=args.dtype, threads=args.threads,
                        policy=args.policy, kv_cache_memory_mb=args.kv_cache_mb, warmup=not args.no_warmup,
                        quantization=args.quantization, gguf_weights=args.gguf_weights,
                        block_activations=args.block_activations,
                        gpu_memory_utilization=args.gpu_memory_utilization or None)


def _lora_arg(text: str) -> tuple[str, str]:
    name, sep, path = text.partition("=")
    if not sep or not name or not path:
        raise SystemExit(f"--lora {text!r}: expected NAME=PATH")
    return name, path


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
    if args.lora or args.enable_lora:
        import dataclasses
        cfg = dataclasses.replace(cfg, lora_adapters=tuple(_lora_arg(x) for x in args.lora), enable_lora=args.enable_lora,
                                  max_loras=args.max_loras, max_lora_rank=args.max_lora_rank)
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
                          session_store=args.session_store, tenant_store=args.tenant_store, data_dir=args.data_dir,
                          tool_dirs=tuple(args.tools_dir), hot_path=not args.no_hot_path)


def cmd_up(args: argparse.Namespace) -> int:
    from sits.api.gateway_server import up
    from sits.runtime.unit_spec import load_runtime_config
    config = args.config
    if config is None and os.path.exists("sits.yaml"):
        config = "sits.yaml"
    cfg = load_runtime_config(config) if config else None
    units = cfg.units if cfg else []
    ray = args.ray or (cfg.ray_address if cfg is not None and cfg.cluster == "ray" else None)
    return up(units, _server_settings(args), data_dir=args.data_dir, host=args.host, port=args.port,
              log_level=args.log_level, prefetch=not args.no_prefetch, ray=ray, memory_budget_mb=args.memory_budget_mb,
              gpu_memory_mb=args.gpu_memory_mb)


def register(sub: argparse._SubParsersAction) -> None:
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
    srv.add_argument("--lora", action="append", default=[], metavar="NAME=PATH",
                     help="serve the PEFT LoRA adapter in PATH as NAME (repeatable); call it as model NAME or "
                          "<served name>:NAME")
    srv.add_argument("--enable-lora", action="store_true",
                     help="accept adapters loaded at run time (POST /v1/load_lora_adapter); implied by --lora")
    srv.add_argument("--max-loras", type=int, default=4, help="adapters resident, and in one step, at most")
    srv.add_argument("--max-lora-rank", type=int, default=64, help="the largest adapter rank served")
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
    upp.add_argument("--memory-budget-mb", type=float, default=None,
                     help="what this host's instances may hold together; a start that does not fit evicts idle "
                          "instances of other units or waits (default: the memory available at start)")
    upp.add_argument("--gpu-memory-mb", type=float, default=None,
                     help="what the instances on each GPU may hold together (weights, KV pools, activations, CUDA "
                          "contexts); a start that does not fit evicts idle instances there or waits (default: 90%% "
                          "of the GPU, or what is free at start if less)")
    upp.add_argument("--ray", nargs="?", const="auto", default=None, metavar="ADDRESS",
                     help="place instances on a Ray cluster's nodes by their unit's resources: auto (the running "
                          "cluster; the default when given bare), an address, or local (a one-node Ray started "
                          "here); default: off (or the config's cluster: ray)")
    _add_http_args(upp)
    upp.set_defaults(func=cmd_up)
