"""``sits bench dtype``: the same checkpoint served in each compute dtype, prefill and decode speed.

This is the measurement behind ``dtype: auto`` on a CPU (bf16 where the CPU multiplies it
natively). Each dtype runs in a child process of its own (weights, allocator and thread pool are
per process), the dtypes taking turns round by round, order reversed every round; figures are
medians over rounds. The baseline is float32, measured in the same run.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys

from sits.bench.common import add_bench_command, log, publish

DOC_BEGIN = "<!-- sits bench dtype: begin -->"
DOC_END = "<!-- sits bench dtype: end -->"
METRICS = {"prefill_ms": "prefill of {prompt} tokens, ms", "decode_b1_ms": "decode, 1 stream, ms per token",
           "decode_b8_ms": "decode, 8 streams, ms per step"}

_CHILD = r"""
import json, statistics, sys, time
cfg = json.loads(sys.argv[1])
from sits.engine.config import EngineConfig
from sits.engine.llm_engine import LLMEngine
from sits.engine.sampling_params import SamplingParams
eng = LLMEngine(EngineConfig(model=cfg["model"], device="cpu", dtype=cfg["dtype"], warmup=False, threads=cfg["threads"],
                             kv_cache_memory_mb=256, max_num_batched_tokens=max(256, cfg["prompt"])))
vocab = eng.model_config.vocab_size
def run(prompts, n):
    t = time.perf_counter()
    eng.generate(prompts, [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for _ in prompts])
    return time.perf_counter() - t
def ids(seed, n):
    return [(seed * 7919 + i * 104729) % (vocab - 10) + 5 for i in range(n)]
run([ids(1, 32)], 4)
steps = cfg["steps"]
out = {"prefill_ms": statistics.median(run([ids(10 + i, cfg["prompt"])], 1) for i in range(3)) * 1e3,
       "decode_b1_ms": statistics.median(run([ids(20 + i, 16)], steps) for i in range(3)) * 1e3 / steps,
       "decode_b8_ms": statistics.median(run([ids(30 + i * 8 + j, 16) for j in range(8)], steps)
                                         for i in range(3)) * 1e3 / steps,
       "resolved_dtype": str(eng.dtype).removeprefix("torch.")}
print(json.dumps(out))
"""


def _measure(model: str, dtype: str, threads: int, prompt: int, steps: int) -> dict:
    child = json.dumps({"model": model, "dtype": dtype, "threads": threads, "prompt": prompt, "steps": steps})
    proc = subprocess.run([sys.executable, "-c", _CHILD, child], capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        raise RuntimeError(f"dtype child ({dtype}) failed: {proc.stderr.strip()[-2000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def run_dtype_bench(model: str, *, dtypes: list[str], threads: int | None = None, rounds: int = 3,
                    prompt: int = 512, steps: int = 32, json_out: str | None = None,
                    docs_out: str | None = None) -> dict:
    threads = threads or os.cpu_count() or 1
    runs: dict[str, list[dict]] = {d: [] for d in dtypes}
    for r in range(rounds):
        for dtype in (dtypes if r % 2 == 0 else list(reversed(dtypes))):
            runs[dtype].append(_measure(model, dtype, threads, prompt, steps))
        log(f"round {r + 1}/{rounds}: " + ", ".join(f"{d} decode {runs[d][-1]['decode_b1_ms']:.1f} ms/token"
                                                    for d in dtypes))
    medians = {d: {m: statistics.median(run[m] for run in runs[d]) for m in METRICS} for d in dtypes}
    resolved = {d: runs[d][0]["resolved_dtype"] for d in dtypes}
    result = {"model": model, "threads": threads, "rounds": rounds, "prompt": prompt, "steps": steps,
              "dtypes": dtypes, "resolved": resolved, "median": medians, "runs": runs,
              "baseline": dtypes[0]}
    return publish(result, "dtype", _markdown, DOC_BEGIN, DOC_END, json_out, docs_out, plot=_plot)


def _markdown(r: dict, command: str, plot_path: str) -> str:
    base = r["baseline"]
    head = "| dtype | " + " | ".join(label.format(prompt=r["prompt"]) for label in METRICS.values()) + \
           f" | speed-up vs {base} (prefill / decode 1 / decode 8) |"
    lines = [DOC_BEGIN, "## Compute dtype on this CPU (`sits bench dtype`)", "", f"Command: `{command}`  ",
             f"Model `{r['model']}`, {r['threads']} thread(s), each dtype in its own process, medians of "
             f"{r['rounds']} rounds taken in turn (order reversed every round), greedy, {r['steps']} decode steps.",
             "", head, "|" + "---|" * (head.count("|") - 1)]
    med = r["median"]
    for d in r["dtypes"]:
        ratio = " / ".join(f"{med[base][m] / med[d][m]:.2f}" for m in METRICS)
        name = d if r["resolved"][d] == d else f"{d} (= {r['resolved'][d]})"
        lines.append(f"| {name} | " + " | ".join(f"{med[d][m]:.1f}" for m in METRICS) + f" | {ratio} |")
    lines += ["", f"![dtype benchmark]({plot_path})", "", DOC_END]
    return "\n".join(lines)


def _plot(r: dict, path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    path.parent.mkdir(parents=True, exist_ok=True)
    metrics = list(METRICS)
    width = 0.8 / len(r["dtypes"])
    fig, ax = plt.subplots(figsize=(8, 4))
    for k, d in enumerate(r["dtypes"]):
        ax.bar([i + k * width for i in range(len(metrics))], [r["median"][d][m] for m in metrics], width, label=d)
    ax.set_xticks([i + width * (len(r["dtypes"]) - 1) / 2 for i in range(len(metrics))],
                  [METRICS[m].format(prompt=r["prompt"]) for m in metrics], fontsize=8)
    ax.set_ylabel("ms (median)")
    ax.set_title(f"{os.path.basename(os.path.normpath(r['model']))}: compute dtype, {r['threads']} thread(s)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _cli(args: argparse.Namespace) -> int:
    r = run_dtype_bench(args.model, dtypes=[d.strip() for d in args.dtypes.split(",") if d.strip()],
                        threads=args.threads, rounds=args.repeats, prompt=args.prompt, steps=args.steps,
                        json_out=args.json, docs_out=args.write_docs)
    print(json.dumps(r["median"], indent=2))
    return 0


def register_cli(subparsers: argparse._SubParsersAction) -> None:
    p = add_bench_command(subparsers, "dtype", "one checkpoint in each compute dtype: prefill and decode speed",
                          _cli, threads="CPU threads per dtype's process",
                          repeats="rounds of every dtype, median reported", repeats_default=3)
    p.add_argument("--dtypes", default="float32,bfloat16,auto",
                   help="comma-separated dtypes; the first is the baseline (default: float32,bfloat16,auto)")
    p.add_argument("--prompt", type=int, default=512, help="prompt tokens of the prefill measurement")
    p.add_argument("--steps", type=int, default=32, help="decode steps per measurement")
