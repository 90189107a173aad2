"""An engine's start in a fresh interpreter (what `sits serve` and a unit without a zygote pay) on two
checkouts of SITS, in separate processes taking turns (order reversed every round), medians of the
rounds: old vs new code in the same run.

    git worktree add /tmp/old HEAD~1
    .venv/bin/python bench/engine_start_ab.py MODEL /tmp/old . [ROUNDS]

Per checkout: the engine's cold-start phases (imports, config, weights, tokenizer, kv_allocation; no
warm-up) and the wall time from the interpreter's start to the engine ready.
"""

import json
import os
import statistics
import subprocess
import sys

CHILD = r"""
import json, sys, time
from sits.engine.config import EngineConfig
from sits.engine.llm_engine import LLMEngine
eng = LLMEngine(EngineConfig(model=sys.argv[1], device="cpu", warmup=False, kv_cache_memory_mb=64))
out = dict(eng.report.to_dict()["phases_ms"])
print(json.dumps(out))
"""


def main(model: str, old: str, new: str, rounds: int = 3) -> None:
    codes = {"old": os.path.abspath(old), "new": os.path.abspath(new)}
    runs: dict[str, list[dict]] = {c: [] for c in codes}
    for r in range(rounds):
        for c in (list(codes) if r % 2 == 0 else list(reversed(codes))):
            env = dict(os.environ, PYTHONPATH=codes[c])
            p = subprocess.run([sys.executable, "-c", CHILD, os.path.abspath(model)], capture_output=True, text=True,
                               env=env, cwd="/", check=True)
            phases = json.loads(p.stdout.strip().splitlines()[-1])
            phases["ready (sum)"] = sum(phases.values())
            runs[c].append(phases)
            print(f"round {r + 1}/{rounds} {c}: {phases}", file=sys.stderr, flush=True)
    keys = [k for k in runs["old"][0] if all(k in x for c in codes for x in runs[c])]
    med = {c: {k: statistics.median(x[k] for x in runs[c]) for k in keys} for c in codes}
    print("| phase (median of %d) | old ms | new ms | new/old |\n|---|---|---|---|" % rounds)
    for k in keys:
        ratio = med["new"][k] / med["old"][k] if med["old"][k] else float("nan")
        print(f"| {k} | {med['old'][k]:.0f} | {med['new'][k]:.0f} | {ratio:.2f} |")


if __name__ == "__main__":
    main(*sys.argv[1:4], *(int(a) for a in sys.argv[4:5]))
