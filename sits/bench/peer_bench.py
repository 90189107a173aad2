"""``sits bench peer``: SITS's decode step against llama.cpp's, on the same GGUF file and threads.

llama.cpp is not a SITS dependency: ``--llama-cpp`` names a folder holding its ``llama-batched-bench``
(built from source; docs/benchmarks.md says how). Each repeat runs, taking turns (the order reversed
every repeat):

- SITS, once per block-activation choice (``fp32``: the blocks with fp32 activations, what an engine
  takes by default for such a file; ``int8``: ``block_activations="int8"``) and stream count, timed as
  ``sits bench step`` times a decode step: ``n`` sequences prefilled with a ``context``-token prompt,
  then ``steps`` decode steps one by one;
- ``llama-batched-bench -npp CONTEXT -ntg STEPS -npl STREAMS``: its text-generation rate (S_TG) for
  every stream count in one call.

Reported: tokens per second (medians over the repeats) and SITS / llama.cpp per choice.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
from pathlib import Path

from sits.bench.common import add_bench_command, grouped_bars, log, print_summary, publish
from sits.bench.engine_bench import Hardware

DOC_BEGIN = "<!-- sits bench peer: begin -->"
DOC_END = "<!-- sits bench peer: end -->"
_PATHS = {"fp32": "cpp_blocks", "int8": "cpp_blocks_int8"}     # step_bench's paths for each choice
BINARY = "llama-batched-bench"


def parse_batched_bench(text: str) -> dict[int, float]:
    """``llama-batched-bench``'s table as {parallel sequences: text-generation tokens/s (S_TG)}."""
    rows: dict[int, float] = {}
    header: list[str] | None = None
    for line in text.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if not line.lstrip().startswith("|") or len(cells) < 2:
            continue
        if "B" in cells and "S_TG t/s" in cells:
            header = cells
        elif header is not None and len(cells) == len(header) and cells[0].isdigit():
            rows[int(cells[header.index("B")])] = float(cells[header.index("S_TG t/s")])
    if not rows:
        raise ValueError(f"no {BINARY} results in its output:\n{text[-2000:]}")
    return rows


def llama_cpp_tok_s(llama_dir: str, model: str, streams: tuple[int, ...], context: int, steps: int,
                    threads: int) -> dict[int, float]:
    binary = Path(llama_dir) / BINARY
    if not binary.is_file():
        raise ValueError(f"{binary} not found (--llama-cpp names the folder holding llama.cpp's {BINARY})")
    ctx = max(streams) * (context + steps) + 64
    cmd = [str(binary), "-m", model, "-c", str(ctx), "-b", "2048", "-ub", "512", "-npp", str(context),
           "-ntg", str(steps), "-npl", ",".join(map(str, streams)), "-t", str(threads)]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=1800)
    if out.returncode != 0:
        raise ValueError(f"{' '.join(cmd)} exited {out.returncode}:\n{out.stderr[-2000:]}")
    return parse_batched_bench(out.stdout + "\n" + out.stderr)


def run_peer_bench(model: str, llama_dir: str, streams: tuple[int, ...] = (1, 4, 16),
                   activations: tuple[str, ...] = ("fp32", "int8"), context: int = 64, steps: int = 32,
                   repeats: int = 3, threads: int | None = None, json_out: str | None = None,
                   docs_out: str | None = None) -> dict:
    from sits.bench.step_bench import decode_step_times, available_paths

    if unknown := [a for a in activations if a not in _PATHS]:
        raise ValueError(f"activations {', '.join(unknown)}: fp32 or int8")
    if not all(_PATHS[a] in available_paths("cpu", model, "float32") for a in activations):
        raise ValueError(f"{model}: SITS serves no GGUF blocks here (a GGUF file and the built CPU kernels needed)")
    threads = threads or os.cpu_count() or 1
    hw = Hardware("cpu", "float32", threads)
    log(f"peer: {model} on {hw.describe()}; SITS {', '.join(activations)} vs llama.cpp, streams {streams}")
    runs: dict[str, dict[int, list[float]]] = {k: {n: [] for n in streams} for k in (*activations, "llama.cpp")}
    turns = [*activations, "llama.cpp"]
    for r in range(repeats):
        for who in (turns if r % 2 == 0 else turns[::-1]):
            if who == "llama.cpp":
                for n, tok_s in llama_cpp_tok_s(llama_dir, model, streams, context, steps, threads).items():
                    if n in runs[who]:
                        runs[who][n].append(tok_s)
            else:
                for n in streams:
                    runs[who][n].append(decode_step_times(model, hw, _PATHS[who], n, context, steps, seed=r)["tok_s"])
            log(f"peer: run {r + 1}/{repeats}: {who} " + ", ".join(f"{n}: {runs[who][n][-1]:.1f} tok/s"
                                                                     for n in streams if runs[who][n]))
    rows = {}
    for n in streams:
        row = {f"{k}_tok_s": statistics.median(v[n]) for k, v in runs.items() if v[n]}
        for a in activations:
            if "llama.cpp_tok_s" in row:
                row[f"{a}_vs_llama.cpp"] = row[f"{a}_tok_s"] / row["llama.cpp_tok_s"]
        rows[str(n)] = row
    result = {"model": model, "hardware": hw.describe(), "context": context, "steps": steps, "repeats": repeats,
              "activations": list(activations), "streams": rows,
              "runs": {k: {str(n): v for n, v in per.items()} for k, per in runs.items()}}
    result["summary"] = {n: {k: round(v, 3) for k, v in row.items()} for n, row in rows.items()}
    return publish(result, "peer", _markdown, DOC_BEGIN, DOC_END, json_out, docs_out, plot=_plot)


def _markdown(result: dict, command: str, plot: str | None) -> str:
    acts = result["activations"]
    head = ("| streams | " + " | ".join(f"SITS {a} tok/s" for a in acts) + " | llama.cpp tok/s | "
            + " | ".join(f"SITS {a} / llama.cpp" for a in acts) + " |")
    lines = [DOC_BEGIN, "## SITS against llama.cpp on one GGUF file (`sits bench peer`)", "",
             f"Command: `{command}`  ",
             f"Host: {result['hardware']}; model: `{result['model']}`; {result['context']}-token prompts, "
             f"{result['steps']} generated; tokens per second of decoding, medians of {result['repeats']} runs "
             "with SITS and llama.cpp taking turns (llama.cpp: `llama-batched-bench`'s S_TG).", "", head,
             "|" + "---|" * (2 + 2 * len(acts))]
    for n, r in result["streams"].items():
        lines.append(f"| {n} | " + " | ".join(f"{r[f'{a}_tok_s']:.1f}" for a in acts)
                     + f" | {r.get('llama.cpp_tok_s', float('nan')):.1f} | "
                     + " | ".join(f"{r.get(f'{a}_vs_llama.cpp', float('nan')):.2f}×" for a in acts) + " |")
    if plot:
        lines += ["", f"![SITS against llama.cpp]({plot})"]
    return "\n".join(lines + ["", DOC_END])


def _plot(result: dict, path) -> None:
    streams = list(result["streams"])
    series = {f"SITS {a}": [result["streams"][n][f"{a}_tok_s"] for n in streams] for a in result["activations"]}
    series["llama.cpp"] = [result["streams"][n].get("llama.cpp_tok_s", 0.0) for n in streams]
    grouped_bars(path, [f"{n} streams" for n in streams], series, ylabel="generated tokens/s",
                 title=f"Decode, {Path(result['model']).name}, {result['hardware']}")


def _cli(args: argparse.Namespace) -> int:
    return print_summary("peer", lambda: run_peer_bench(
        args.model, args.llama_cpp, tuple(int(s) for s in args.streams.split(",")),
        tuple(a for a in args.activations.split(",") if a), args.context, args.steps, args.repeats, args.threads,
        args.json, args.write_docs))


def register_cli(subparsers: argparse._SubParsersAction) -> None:
    p = add_bench_command(subparsers, "peer", "SITS's decode against llama.cpp's on the same GGUF file", _cli,
                          threads="threads for SITS and llama.cpp alike", repeats="runs per figure, median reported",
                          repeats_default=3)
    p.add_argument("--llama-cpp", required=True, help=f"the folder holding llama.cpp's {BINARY}")
    p.add_argument("--streams", default="1,4,16", help="comma-separated sequences decoded at once")
    p.add_argument("--activations", default="fp32,int8", help="SITS's block activations to run (fp32, int8)")
    p.add_argument("--context", type=int, default=64, help="prompt tokens per sequence")
    p.add_argument("--steps", type=int, default=32, help="decode steps timed per run")
