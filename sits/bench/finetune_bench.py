"""``sits bench finetune``: the first training step of a LoRA job after a restart, against a cold one.

One job (random chats on ``--model``, a rank-16 adapter on the attention projections) is trained to
a snapshot first. Then, each round, with the cases taking turns, the time from the (re)start of an
attempt to its first finished optimizer step:

- cold: a fresh process starts the job from scratch (the interpreter, torch, the weights, the
  dataset, then a first step with nothing warm);
- restart, fresh process: a fresh process resumes from the snapshot (what a job without a warm
  supervisor pays after a crash);
- restart, forked: the supervisor that holds the prepared model and data forks the attempt, which
  resumes from the snapshot (``sits.finetune.supervisor``: what ``sits finetune`` does).

Also reported: the first step alone (inside the process, after loading), cold and resumed.
"""

from __future__ import annotations

import argparse
import json
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from sits.bench.common import add_bench_command, grouped_bars, log, publish

DOC_BEGIN = "<!-- sits bench finetune: begin -->"
DOC_END = "<!-- sits bench finetune: end -->"
CASES = ("cold", "restart, fresh process", "restart, forked")
_ATTEMPT = ("import sys, json; from sits.finetune.spec import FinetuneSpec; from sits.finetune.trainer import FinetuneJob; "
            "FinetuneJob(FinetuneSpec.model_validate_json(open(sys.argv[1]).read()), sys.argv[2]).run(stop_after=1)")


def _dataset(folder: Path, n: int = 64) -> None:
    rng = random.Random(0)
    words = "red green blue apple lime grape river stone cloud quiet bright small north south".split()
    folder.mkdir(parents=True, exist_ok=True)
    with open(folder / "chats.jsonl", "w") as f:
        for _ in range(n):
            q = " ".join(rng.choice(words) for _ in range(12))
            a = " ".join(rng.choice(words) for _ in range(24))
            f.write(json.dumps({"messages": [{"role": "user", "content": q}, {"role": "assistant", "content": a}]})
                    + "\n")


def _first_step(folder: Path) -> tuple[float, float]:
    """(wall clock when the attempt's first step finished, that step's own ms) from its events."""
    last = json.loads((folder / "events.jsonl").read_text().splitlines()[-1])
    return last["first_step_done_at"], last["first_step_ms"]


def _fresh(spec_path: Path, folder: Path) -> tuple[float, float]:
    t0 = time.time()
    subprocess.run([sys.executable, "-c", _ATTEMPT, str(spec_path), str(folder)], check=True,
                   stdout=subprocess.DEVNULL)
    done, step_ms = _first_step(folder)
    return done - t0, step_ms


def worker(spec_path: str) -> int:
    """The warm supervisor: prepares once, then forks one attempt (stop after its first step) per
    folder named on stdin, printing when it forked it."""
    from sits.finetune.spec import FinetuneSpec
    from sits.finetune.supervisor import fork_attempt, prepare
    spec = FinetuneSpec.model_validate_json(Path(spec_path).read_text())
    prepared = prepare(spec)
    print("ready", flush=True)
    for line in sys.stdin:
        t0 = time.time()
        code = fork_attempt(spec, line.strip(), prepared, stop_after=1)
        print(json.dumps({"t0": t0, "code": code}), flush=True)
    return 0


def run_finetune_bench(model: str, *, rounds: int = 5, steps_before: int = 20, json_out: str | None = None,
                       docs_out: str | None = None) -> dict:
    from sits.finetune.spec import FinetuneSpec
    from sits.finetune.trainer import FinetuneJob
    tmp = Path(tempfile.mkdtemp(prefix="sits-finetune-bench-"))
    try:
        _dataset(tmp / "data")
        spec = FinetuneSpec(name="bench", model=model, dataset=str(tmp / "data"), rank=16, alpha=32, steps=1000,
                            batch_size=4, max_len=128, snapshot_every=steps_before)
        spec_path = tmp / "spec.json"
        spec_path.write_text(spec.model_dump_json())
        log(f"training {steps_before} steps to a snapshot")
        FinetuneJob(spec, tmp / "snap").run(stop_after=steps_before)
        sup = subprocess.Popen([sys.executable, "-m", "sits.bench.finetune_bench", "--worker", str(spec_path)],
                               stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        assert sup.stdout.readline().strip() == "ready"
        runs: dict[str, list[float]] = {c: [] for c in CASES}
        step_ms: dict[str, list[float]] = {"cold": [], "resumed": []}
        for r in range(rounds):
            for case in (CASES if r % 2 == 0 else tuple(reversed(CASES))):
                folder = tmp / f"{case.replace(' ', '_').replace(',', '')}_{r}"
                if case != "cold":
                    shutil.copytree(tmp / "snap", folder)
                if case == "restart, forked":
                    sup.stdin.write(f"{folder}\n")
                    sup.stdin.flush()
                    t0 = json.loads(sup.stdout.readline())["t0"]
                    done, ms = _first_step(folder)
                    seconds = done - t0
                else:
                    seconds, ms = _fresh(spec_path, folder)
                runs[case].append(seconds)
                step_ms["cold" if case == "cold" else "resumed"].append(ms)
            log(f"round {r + 1}/{rounds}: " + ", ".join(f"{c} {runs[c][-1] * 1e3:.0f} ms" for c in CASES))
        sup.stdin.close()
        sup.wait(30)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    med = {c: statistics.median(v) for c, v in runs.items()}
    result = {"model": model, "rounds": rounds, "steps_before_snapshot": steps_before, "seconds": med, "runs": runs,
              "first_step_ms": {k: statistics.median(v) for k, v in step_ms.items()},
              "forked_vs_cold": med["restart, forked"] / med["cold"],
              "fresh_restart_vs_cold": med["restart, fresh process"] / med["cold"]}
    return publish(result, "finetune", _markdown, DOC_BEGIN, DOC_END, json_out, docs_out, plot=_plot)


def _plot(r: dict, path) -> None:
    grouped_bars(path, list(CASES), {"to the first step, ms": [r["seconds"][c] * 1e3 for c in CASES]},
                 ylabel="ms from (re)start to first step done", title="LoRA fine-tuning: cold vs restarted attempt")


def _markdown(r: dict, command: str, plot: str) -> str:
    s, ms = r["seconds"], r["first_step_ms"]
    lines = [DOC_BEGIN, "## Fine-tuning: the first step after a restart (`sits bench finetune`)", "",
             f"Command: `{command}`  ",
             f"Model `{r['model']}`, a rank-16 LoRA on the attention projections, batch 4, 128-token chats; the job "
             f"snapshotted at step {r['steps_before_snapshot']} (adapter, AdamW moments, data position, RNG); medians "
             f"of {r['rounds']} rounds with the cases taking turns. Time from the attempt's start (process spawn, or "
             "fork) to its first finished optimizer step.", "",
             "| attempt | to first step, ms | vs cold |", "|---|---|---|"]
    for c in CASES:
        lines.append(f"| {c} | {s[c] * 1e3:.0f} | {s[c] / s['cold']:.2f}× |")
    lines += ["", f"The step alone (inside the process, after loading): cold {ms['cold']:.0f} ms, resumed "
              f"{ms['resumed']:.0f} ms. Target (issue 20): a restarted job's first step ≤ 0.33× a cold one: forked "
              f"{r['forked_vs_cold']:.2f}×, fresh process {r['fresh_restart_vs_cold']:.2f}×. Either restart continues "
              f"from step {r['steps_before_snapshot']} instead of step 0. The forked attempt skips the interpreter, torch's import, "
              "the weights and the dataset, and the optimizer's first construction (which imports torch's compiler "
              "stack), all paid once by the supervisor.", "", f"![fine-tuning restarts]({plot})", "",
              DOC_END]
    return "\n".join(lines)


def _cli(args: argparse.Namespace) -> int:
    r = run_finetune_bench(args.model, rounds=args.repeats, json_out=args.json, docs_out=args.write_docs)
    print(json.dumps({k: r[k] for k in ("seconds", "first_step_ms", "forked_vs_cold", "fresh_restart_vs_cold")},
                     indent=2))
    return 0


def register_cli(subparsers: argparse._SubParsersAction) -> None:
    add_bench_command(subparsers, "finetune", "a LoRA job's first step after a restart from its snapshot vs cold",
                      _cli, repeats="rounds of every case, median reported", repeats_default=5)


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--worker", required=True)
    sys.exit(worker(ap.parse_args().worker))
