"""An engine's start in a fresh interpreter (what `sits serve` and a unit without a zygote pay) on two
checkouts of SITS, in separate processes taking turns (order reversed every round), medians of the
rounds: old vs new code in the same run.

    git worktree add /tmp/old f5001d6       # the code before SITS decoded GGUF itself
    .venv/bin/python bench/engine_start_ab.py MODEL /tmp/old . [ROUNDS]

Per checkout: the engine's cold-start phases (imports, config, weights, tokenizer, kv_allocation; no
warm-up) and their sum ("imports" counts from the interpreter's start, so the sum is the time to ready).
"""

import os
import sys

from ab import alternate, medians

CHILD = r"""
import json, sys, time
from sits.engine.config import EngineConfig
from sits.engine.llm_engine import LLMEngine
eng = LLMEngine(EngineConfig(model=sys.argv[1], device="cpu", warmup=False, kv_cache_memory_mb=64))
out = dict(eng.report.to_dict()["phases_ms"])
print(json.dumps(out))
"""


def main(model: str, old: str, new: str, rounds: int = 3) -> None:
    runs = alternate(CHILD, [os.path.abspath(model)], old, new, rounds)
    for phases in (x for xs in runs.values() for x in xs):
        phases["ready (sum)"] = sum(phases.values())
    med = medians(runs)
    print("| phase (median of %d) | old ms | new ms | new/old |\n|---|---|---|---|" % rounds)
    for k, a in med["old"].items():
        ratio = med["new"][k] / a if a else float("nan")
        print(f"| {k} | {a:.0f} | {med['new'][k]:.0f} | {ratio:.2f} |")


if __name__ == "__main__":
    main(*sys.argv[1:4], *(int(a) for a in sys.argv[4:5]))
