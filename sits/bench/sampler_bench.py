"""``sits bench sampler``: what one engine step's sampling costs, per kind of batch.

Each variant runs in a child process of its own (the allocator state is per process, and so is
the thread count), the variants taking turns round by round so drift on a busy host hits them
all. The variants:

- ``heap``: this checkout's sampler with the step buffers kept in the heap (what the engine does);
- ``mmap``: the same code with glibc's default thresholds (the baseline the heap setting is
  measured against);
- with ``--baseline-code CHECKOUT``, also ``old code``: another checkout's sampler, heap setting on,
  for an old-vs-new comparison of the sampler itself.

Logits are random (scaled normal), so a top-p row's nucleus is wide: that case is the slow path
(the sort fallback), not what a trained model's peaked logits cost.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

from sits.bench.common import add_bench_command, grouped_bars, log, publish, revision

DOC_BEGIN = "<!-- sits bench sampler: begin -->"
DOC_END = "<!-- sits bench sampler: end -->"
CASES = {   # name: (batch rows, SamplingParams keyword arguments)
    "greedy, 1 row": (1, {"temperature": 0.0}),
    "greedy": (None, {"temperature": 0.0}),
    "temperature 1.0": (None, {"temperature": 1.0}),
    "temperature 0.8, top-k 50": (None, {"temperature": 0.8, "top_k": 50}),
    "temperature 0.8, top-p 0.95": (None, {"temperature": 0.8, "top_p": 0.95}),
}
HOST_MEMORY = Path(__file__).resolve().parent.parent / "engine" / "host_memory.py"

# Run in the child with PYTHONPATH at the code under test; the heap setting is loaded from this
# checkout by path, so an old checkout without it is measured with it too.
_CHILD = r"""
import importlib.util, json, statistics, sys, time
import torch
cfg = json.loads(sys.argv[1])
if cfg["heap"]:
    spec = importlib.util.spec_from_file_location("sits_host_memory", cfg["host_memory"])
    module = importlib.util.module_from_spec(spec); spec.loader.exec_module(module)
    assert module.keep_step_buffers_in_heap(), "glibc thresholds not set"
torch.set_num_threads(cfg["threads"])
from sits.engine.sampler import Sampler
from sits.engine.sampling_params import SamplingParams
torch.manual_seed(0)
logits = torch.randn(cfg["batch"], cfg["vocab"]) * 3
sampler = Sampler()
out = {}
for name, (rows, kwargs) in cfg["cases"].items():
    rows = rows or cfg["batch"]
    params = [SamplingParams(max_tokens=16, **kwargs) for _ in range(rows)]
    args = (logits[:rows], params, [[] for _ in range(rows)], [[1, 2, 3] for _ in range(rows)], [None] * rows)
    for _ in range(5):
        sampler.sample(*args)
    times = []
    deadline = time.perf_counter() + cfg["seconds"]
    while len(times) < 20 or time.perf_counter() < deadline:
        t = time.perf_counter(); sampler.sample(*args); times.append(time.perf_counter() - t)
    out[name] = statistics.median(times) * 1e6
print(json.dumps(out))
"""


def _measure(code_dir: str, heap: bool, cfg: dict) -> dict[str, float]:
    env = dict(os.environ, PYTHONPATH=code_dir)
    child = json.dumps({**cfg, "heap": heap, "host_memory": str(HOST_MEMORY)})
    proc = subprocess.run([sys.executable, "-c", _CHILD, child], env=env, capture_output=True, text=True,
                          check=False, cwd=code_dir)
    if proc.returncode != 0:
        raise RuntimeError(f"sampler child failed ({code_dir}): {proc.stderr.strip()[-2000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def run_sampler_bench(*, batch: int = 32, vocab: int = 49152, threads: int = 1, rounds: int = 3,
                      seconds: float = 1.0, baseline_code: str | None = None, json_out: str | None = None,
                      docs_out: str | None = None) -> dict:
    here = str(Path(__file__).resolve().parents[2])
    variants = {"heap": (here, True), "mmap": (here, False)}
    if baseline_code:
        variants[f"old code ({revision(baseline_code)})"] = (str(Path(baseline_code).resolve()), True)
    cfg = {"batch": batch, "vocab": vocab, "threads": threads, "seconds": seconds, "cases": CASES}
    runs: dict[str, list[dict[str, float]]] = {v: [] for v in variants}
    for r in range(rounds):
        order = list(variants) if r % 2 == 0 else list(reversed(variants))
        for variant in order:
            runs[variant].append(_measure(*variants[variant], cfg))
        log(f"round {r + 1}/{rounds}: " + ", ".join(
            f"{v} {runs[v][-1]['temperature 1.0']:.0f} us" for v in variants) + " (temperature 1.0)")
    medians = {v: {case: statistics.median(run[case] for run in runs[v]) for case in CASES} for v in variants}
    result = {"batch": batch, "vocab": vocab, "threads": threads, "rounds": rounds, "variants": list(variants),
              "median_us": medians, "runs_us": runs, "revision": revision(here)}
    return publish(result, "sampler", _markdown, DOC_BEGIN, DOC_END, json_out, docs_out, plot=_plot)


def _markdown(r: dict, command: str, plot_path: str) -> str:
    variants = r["variants"]
    med = r["median_us"]
    head = "| case | " + " | ".join(f"{v} µs" for v in variants) + " | mmap / heap |"
    if len(variants) > 2:
        head += f" {variants[2]} / heap |"
    lines = [DOC_BEGIN, "## Sampling one step (`sits bench sampler`)", "", f"Command: `{command}`  ",
             f"One step's `Sampler.sample` on [{r['batch']}, {r['vocab']}] random logits (scaled normal), "
             f"{r['threads']} thread(s), each variant in its own process, medians of {r['rounds']} rounds taken in "
             f"turn (order reversed every round); `heap` = this checkout with the engine's glibc thresholds "
             f"(`sits/engine/host_memory.py`), `mmap` = the same code with glibc's defaults.", "",
             head, "|" + "---|" * (head.count("|") - 1)]
    for case in CASES:
        row = f"| {case} | " + " | ".join(f"{med[v][case]:.0f}" for v in variants)
        row += f" | {med['mmap'][case] / med['heap'][case]:.2f} |"
        if len(variants) > 2:
            row += f" {med[variants[2]][case] / med['heap'][case]:.2f} |"
        lines.append(row)
    lines += ["", "`mmap / heap` above 1 is what the heap setting saves: with glibc's defaults a step's "
              "multi-megabyte buffers (probabilities, their cumulative sum) can go back to the OS when freed and "
              "fault in again on the next step, so the same code runs at either speed from process to process. "
              "The old-code column is the sampler before its validity check (`failed_rows`), under the same "
              "heap setting.", "", "Top-p on random logits takes the sort fallback (the nucleus is wider than the top "
              "1024 candidates); a trained model's logits rarely do.", "", f"![sampler benchmark]({plot_path})",
              "", DOC_END]
    return "\n".join(lines)


def _plot(r: dict, path: Path) -> None:
    cases = list(CASES)
    grouped_bars(path, cases, {v: [r["median_us"][v][c] for c in cases] for v in r["variants"]},
                 ylabel="µs per step (median)", title=f"Sampler, [{r['batch']}, {r['vocab']}] logits, "
                 f"{r['threads']} thread(s)", log_scale=True)


def _cli(args: argparse.Namespace) -> int:
    r = run_sampler_bench(batch=args.batch, vocab=args.vocab, threads=args.threads, rounds=args.repeats,
                          seconds=args.seconds, baseline_code=args.baseline_code, json_out=args.json,
                          docs_out=args.write_docs)
    print(json.dumps(r["median_us"], indent=2))
    return 0


def register_cli(subparsers: argparse._SubParsersAction) -> None:
    p = add_bench_command(subparsers, "sampler", "one step's sampling: heap vs mmap step buffers (and old code)",
                          _cli, model=False, repeats="rounds of every variant, median reported", repeats_default=3)
    p.add_argument("--threads", type=int, default=1, help="CPU threads per variant's process (default: 1)")
    p.add_argument("--batch", type=int, default=32, help="rows of logits")
    p.add_argument("--vocab", type=int, default=49152, help="vocabulary size (columns)")
    p.add_argument("--seconds", type=float, default=1.0, help="timing window per case and run")
    p.add_argument("--baseline-code", default=None, metavar="CHECKOUT",
                   help="also measure another checkout's sampler (e.g. `git worktree add /tmp/old HEAD~1`)")
