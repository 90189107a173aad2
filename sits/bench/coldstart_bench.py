"""``sits bench coldstart``: from "no instance" to the first token, against what a plain serverless
function does, in the same run, same model and prompt.

- ``naive``: a fresh Python process imports transformers, loads the model with ``from_pretrained``,
  loads the tokenizer and generates one token; timed from process start to that token.
- ``sits_cold``: a request to a unit at zero instances on a running gateway (``sits up``, zygote
  up), timed from sending it to its first streamed token; the unit is scaled back to zero after.
- ``sits_warm``: the same request to a READY instance.

With ``--no-server`` (a GPU host without the HTTP server's packages) the cold path is the engine's
alone: a child forked from the benchmark's process, which has imported torch and the engine but
created no CUDA context (as the zygote has), builds the engine with a minimal warm-up and generates
one token; timed from the fork to that token. Warm is the same child's next one-token request.

Medians of ``--repeats`` starts each (≥ 5 by default), the phase breakdown of the SITS cold starts
(fork, weights, tokenizer, KV allocation, warm-up), and a markdown section with the command.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import TYPE_CHECKING

from sits.bench.common import add_bench_command, log, publish, start_sits, stop_sits, wait_until

if TYPE_CHECKING:
    import httpx

DOC_BEGIN = "<!-- sits bench coldstart: begin -->"
DOC_END = "<!-- sits bench coldstart: end -->"
PROMPT = "The Python language reference says that"

NAIVE = r"""
import sys, time
t0 = time.time()
from transformers import AutoModelForCausalLM, AutoTokenizer
import torch
device, dtype = sys.argv[3], getattr(torch, sys.argv[4])
model = AutoModelForCausalLM.from_pretrained(sys.argv[1], torch_dtype=dtype).to(device)
tok = AutoTokenizer.from_pretrained(sys.argv[1])
ids = tok(sys.argv[2], return_tensors="pt").input_ids.to(device)
with torch.no_grad():
    out = model.generate(ids, max_new_tokens=1, do_sample=False)
print(f"TOKEN {time.time():.6f} {out[0, -1].item()}", flush=True)
"""


def naive_once(model_dir: str, device: str = "cpu", dtype: str = "float32") -> float:
    """Milliseconds from launching the process to its first generated token (weights loaded to
    ``device`` in ``dtype``)."""
    t0 = time.time()
    r = subprocess.run([sys.executable, "-c", NAIVE, model_dir, PROMPT, device, dtype], capture_output=True, text=True,
                       timeout=600, env={**os.environ, "TRANSFORMERS_VERBOSITY": "error", "HF_HUB_OFFLINE": "1"})
    line = next((ln for ln in r.stdout.splitlines() if ln.startswith("TOKEN ")), None)
    if line is None:
        raise RuntimeError(f"naive baseline failed: {r.stderr[-2000:]}")
    return (float(line.split()[1]) - t0) * 1e3


def forked_engine_once(model_dir: str, device: str, dtype: str, warmup: str, threads: int | None = None) -> dict:
    """A child forked from this process starts an engine and generates one token, then another on the
    same engine: both times (ms from the fork and for the second request), the cold-start phases and
    the device's name. This process must never create a CUDA context (a fork could not use CUDA)."""
    from sits.engine.config import EngineConfig
    from sits.engine.llm_engine import LLMEngine
    from sits.engine.sampling_params import SamplingParams

    params = SamplingParams(max_tokens=1, temperature=0.0)
    read_end, write_end = os.pipe()
    t0 = time.monotonic()
    pid = os.fork()
    if pid == 0:                                      # the instance
        status = 1
        try:
            os.close(read_end)
            # warm-up "false" is what a unit's start does with a request waiting: none, and the KV
            # pool faulted in (and the decode graphs captured) when idle
            engine = LLMEngine(EngineConfig(model=model_dir, device=device, dtype=dtype, kv_cache_memory_mb=64,
                                            threads=threads, warmup=warmup != "false",
                                            warmup_shapes="minimal" if warmup == "minimal" else "all",
                                            kv_touch="background" if warmup == "false" else "eager"))
            engine.generate([PROMPT], params)
            cold_ms = (time.monotonic() - t0) * 1e3
            t1 = time.monotonic()
            engine.generate([PROMPT + " it"], params)
            warm_ms = (time.monotonic() - t1) * 1e3
            import torch
            name = torch.cuda.get_device_name(engine.device) if engine.device.type == "cuda" else "cpu"
            os.write(write_end, json.dumps({"cold_ms": cold_ms, "warm_ms": warm_ms, "device_name": name,
                                            "phases_ms": engine.report.phases_ms}).encode())
            status = 0
        except BaseException:            # os._exit below skips Python's own report of it
            traceback.print_exc()
            sys.stderr.flush()
        finally:
            os._exit(status)
    os.close(write_end)
    with os.fdopen(read_end, "rb") as r:
        data = r.read()
    _, status = os.waitpid(pid, 0)
    if status != 0 or not data:
        raise RuntimeError(f"the forked engine failed (wait status {status})")
    return json.loads(data)


_CLIENT: httpx.Client | None = None


def first_token_ms(url: str, unit: str) -> float:
    """Send -> first streamed token, on one reused client (a new httpx client costs ~35 ms of TLS setup)."""
    global _CLIENT
    if _CLIENT is None:
        import httpx    # not at the top: `sits --help` imports every benchmark module
        _CLIENT = httpx.Client(timeout=600)
    body = {"model": unit, "prompt": PROMPT, "max_tokens": 1, "temperature": 0, "stream": True}
    t0 = time.perf_counter()
    with _CLIENT.stream("POST", url + "/v1/completions", json=body) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if line.startswith("data: {") and '"text"' in line:
                return (time.perf_counter() - t0) * 1e3
    raise RuntimeError("no token streamed")


def run_coldstart_bench(model_dir: str, *, repeats: int = 5, json_out: str | None = None,
                        docs_out: str | None = None, threads: int | None = None, skip_naive: bool = False,
                        warmup: str = "all", device: str = "cpu", dtype: str = "auto",
                        server: bool = True) -> dict:
    """``device``/``dtype``: the unit's and the naive baseline's (``auto`` for the unit means the
    checkpoint's own dtype; the baseline then loads in float32 on a CPU, bfloat16 on a GPU)."""
    shown = model_dir
    model_dir = str(Path(model_dir).resolve())
    work = Path(tempfile.mkdtemp(prefix="sits-coldstart-"))
    res = (f"{{device: {device}, dtype: {dtype}, kv_cache_mb: 64, warmup: {warmup}"
           f"{', threads: ' + str(threads) if threads else ''}}}")
    naive_dtype = dtype if dtype != "auto" else ("bfloat16" if device.startswith("cuda") else "float32")
    (work / "sits.yaml").write_text(f"units:\n  - name: cold\n    model: {model_dir}\n"
                                    f"    scale: {{min_instances: 0, max_instances: 1, keep_alive_s: 3600}}\n"
                                    f"    resources: {res}\n")
    # the GPU's name comes from the instances: this process creates no CUDA context (forks could not use one)
    result: dict = {"model": shown, "repeats": repeats, "host": f"{os.cpu_count()} CPU cores; {device}, {dtype}",
                    "warmup": warmup}
    naive: list[float] = []
    if not skip_naive:
        for i in range(repeats):
            naive.append(naive_once(model_dir, device, naive_dtype))
            log(f"naive start {i + 1}/{repeats}: {naive[-1]:.0f} ms")
    cold: list[float] = []
    warm: list[float] = []
    phases: list[dict] = []
    if not server:
        result["host"] += "; engine forked from the benchmark's process, no server"
        for i in range(repeats):
            run = forked_engine_once(model_dir, device, dtype, warmup, threads)
            if i == 0 and run["device_name"] != "cpu":
                result["host"] = f"{run['device_name']}, {result['host']}"
            cold.append(run["cold_ms"])
            warm.append(run["warm_ms"])
            phases.append(run["phases_ms"])
            log(f"forked engine {i + 1}/{repeats}: cold {cold[-1]:.0f} ms, warm {warm[-1]:.1f} ms; {phases[-1]}")
        shutil.rmtree(work, ignore_errors=True)
        return _publish(result, naive, cold, warm, phases, json_out, docs_out)
    import httpx
    proc, url = start_sits(["up", "--config", str(work / "sits.yaml"), "--data-dir", str(work / "data")])
    try:
        wait_until(lambda: any(e["event"] == "zygote_ready" for e in httpx.get(url + "/v1/status").json()["events"]),
              120, "the zygote")
        # a GPU unit's weights are kept in host memory by a loader process: time starts from that copy
        wait_until(lambda: (httpx.get(url + "/v1/units/cold").json().get("host_copy") or {}).get("state") != "loading",
                   1800, "the unit's host copy")
        for i in range(repeats):
            wait_until(lambda: httpx.get(url + "/v1/units/cold").json()["instances"] == [], 60, "zero instances")
            cold.append(first_token_ms(url, "cold"))
            view = httpx.get(url + "/v1/units/cold").json()
            phases.append(view["instances"][0]["cold_start_ms"])
            for _ in range(2):
                warm.append(first_token_ms(url, "cold"))
            log(f"sits start {i + 1}/{repeats}: cold {cold[-1]:.0f} ms, warm {warm[-1]:.1f} ms; {phases[-1]}")
            httpx.post(url + "/v1/units/cold/scale", json={"instances": 0}).raise_for_status()
    finally:
        stop_sits(proc)
        shutil.rmtree(work, ignore_errors=True)
    return _publish(result, naive, cold, warm, phases, json_out, docs_out)


def _publish(result: dict, naive: list[float], cold: list[float], warm: list[float], phases: list[dict],
             json_out: str | None, docs_out: str | None) -> dict:
    med_phases = {k: statistics.median(p.get(k, 0.0) for p in phases) for k in phases[0]}
    result.update({
        "naive_ms": statistics.median(naive) if naive else None, "sits_cold_ms": statistics.median(cold),
        "sits_warm_ms": statistics.median(warm), "naive_runs_ms": naive, "sits_cold_runs_ms": cold,
        "sits_warm_runs_ms": warm, "phases_ms": med_phases})
    result["ratio_cold_vs_naive"] = result["sits_cold_ms"] / result["naive_ms"] if naive else None
    result["ratio_cold_vs_warm"] = result["sits_cold_ms"] / result["sits_warm_ms"]
    return publish(result, "coldstart", _markdown, DOC_BEGIN, DOC_END, json_out, docs_out)


def _markdown(r: dict, command: str) -> str:
    def f(v, spec=".0f"):
        return "-" if v is None else format(v, spec)

    forked = "no server" in r["host"]
    cold_path = "an engine forked from a process holding torch" if forked else "unit at zero instances, zygote up"
    warm_path = "the same engine, next request" if forked else "READY instance"
    lines = [DOC_BEGIN, "## Cold start (`sits bench coldstart`)", "", f"Command: `{command}`  ",
             f"Host: {r['host']}; model `{r['model']}`; unit warm-up `{r['warmup']}`; medians of {r['repeats']} starts "
             "each; one streamed token.", "",
             "| path | first token, median ms | runs |", "|---|---|---|",
             f"| naive (fresh python: import transformers, from_pretrained, tokenizer, generate) | "
             f"{f(r['naive_ms'])} | {', '.join(f(x) for x in r['naive_runs_ms'])} |",
             f"| sits_cold ({cold_path}) | {f(r['sits_cold_ms'])} | "
             f"{', '.join(f(x) for x in r['sits_cold_runs_ms'])} |",
             f"| sits_warm ({warm_path}) | {f(r['sits_warm_ms'], '.1f')} | "
             f"{', '.join(f(x, '.1f') for x in r['sits_warm_runs_ms'])} |", "",
             f"ratio_cold_vs_naive **{f(r['ratio_cold_vs_naive'], '.3f')}** (target ≤ 0.05); "
             f"sits_cold / sits_warm **{f(r['ratio_cold_vs_warm'], '.1f')}** (target ≤ 3).", "",
             "SITS cold-start phases (median ms): " +
             ", ".join(f"{k} {v:.0f}" for k, v in r["phases_ms"].items()), "", DOC_END]
    return "\n".join(lines)


def _cli(args: argparse.Namespace) -> int:
    r = run_coldstart_bench(args.model, repeats=args.repeats, json_out=args.json, docs_out=args.write_docs,
                            threads=args.threads, skip_naive=args.skip_naive, warmup=args.warmup,
                            device=args.device, dtype=args.dtype, server=not args.no_server)
    print(json.dumps({k: (round(v, 3) if isinstance(v, float) else v) for k, v in r.items()
                      if not k.endswith("_runs_ms")}, indent=2))
    return 0


def register_cli(subparsers: argparse._SubParsersAction) -> None:
    p = add_bench_command(subparsers, "coldstart",
                          "no instance -> first token: naive transformers vs SITS cold vs warm", _cli,
                          threads="CPU threads per instance",
                          repeats="starts measured per variant, median reported", repeats_default=5)
    p.add_argument("--warmup", default="all", choices=["all", "minimal", "false"], help="the unit's warm-up")
    p.add_argument("--skip-naive", action="store_true", help="SITS cold/warm only (no transformers baseline)")
    p.add_argument("--device", default="cpu", help="the unit's device and the naive baseline's (cpu, cuda, cuda:N)")
    p.add_argument("--no-server", action="store_true",
                   help="cold = an engine forked from this process (as the zygote forks instances), no HTTP server")
    p.add_argument("--dtype", default="auto", help="the unit's dtype and the baseline's (auto: the checkpoint's for "
                   "the unit; the baseline then loads float32 on a CPU, bfloat16 on a GPU)")
