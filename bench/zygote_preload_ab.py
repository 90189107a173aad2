"""A unit's start while the zygote builds another (GPU) unit's host copy, on two checkouts of SITS in
separate processes taking turns (order reversed every round), medians of the rounds: old vs new code
in the same run.

    git worktree add /tmp/old f5001d6       # the code before the loader
    .venv/bin/python bench/zygote_preload_ab.py CPU_MODEL GPU_MODEL /tmp/old . [ROUNDS]

Per checkout, with a fresh zygote: the CPU unit is deployed and started once (its weights preloaded);
then the GPU unit is deployed (its weights are read, converted to bf16, merged and copied into shared
host memory; no GPU is needed for that) and a start of the CPU unit, then one of the GPU unit, are
asked for at once. Reported: how long each start's fork took to come back, and when the GPU unit's
host copy was in. The GPU unit's instance itself cannot start on a host without CUDA; it is killed.
"""

import os
import sys

from ab import alternate, medians

CHILD = r"""
import asyncio, json, sys, tempfile, time
from dataclasses import asdict
from sits.engine.config import EngineConfig
from sits.runtime.zygote import ZygoteClient

async def main():
    z = await ZygoteClient.start()
    d = tempfile.mkdtemp()
    cpu = asdict(EngineConfig(model=sys.argv[1], device="cpu", warmup=False, kv_cache_memory_mb=16))
    gpu = asdict(EngineConfig(model=sys.argv[2], device="cuda", warmup=False, kv_cache_memory_mb=16))
    try:
        z.preload(cpu)
        first = await z.fork(d + "/a.sock", cpu)      # returns once its weights are preloaded
        first.kill()
        t0 = time.perf_counter()
        z.preload(gpu)
        child = await z.fork(d + "/b.sock", cpu)
        cpu_ms = (time.perf_counter() - t0) * 1e3
        gpu_child = await z.fork(d + "/c.sock", gpu)
        gpu_ms = (time.perf_counter() - t0) * 1e3
        if hasattr(z, "wait_preloaded"):              # a copy built apart: reported when it is in
            await z.wait_preloaded(gpu, 600)
        copy_ms = (time.perf_counter() - t0) * 1e3    # (before: the GPU fork came back once it was)
        for c in (child, gpu_child):
            c.kill()
    finally:
        await z.shutdown()
    print(json.dumps({"cpu_start_fork_ms": cpu_ms, "gpu_start_fork_ms": gpu_ms, "gpu_copy_ready_ms": copy_ms}))

asyncio.run(main())
"""


def main(cpu_model: str, gpu_model: str, old: str, new: str, rounds: int = 3) -> None:
    med = medians(alternate(CHILD, [os.path.abspath(cpu_model), os.path.abspath(gpu_model)], old, new, rounds))
    print("| measure (median of %d) | old ms | new ms | new/old |\n|---|---|---|---|" % rounds)
    for k, a in med["old"].items():
        print(f"| {k} | {a:.0f} | {med['new'][k]:.0f} | {med['new'][k] / a:.2f} |")


if __name__ == "__main__":
    main(*sys.argv[1:5], *(int(a) for a in sys.argv[5:6]))
