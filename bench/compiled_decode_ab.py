"""A decode step through ``torch.compile`` (inductor, dynamic shapes) vs eager, same engine, same
process, eager before and after: is a compiled decode step worth paying for on this CPU?

    .venv/bin/python bench/compiled_decode_ab.py MODEL_DIR [THREADS]

One stream after a 64-token prompt; the median of 55 step times per variant. The compile itself
(first compiled steps) is timed separately.
"""

import statistics
import sys
import time

import torch

from sits.engine.config import EngineConfig
from sits.engine.llm_engine import LLMEngine
from sits.engine.sampling_params import SamplingParams

threads = int(sys.argv[2]) if len(sys.argv) > 2 else 2
eng = LLMEngine(EngineConfig(model=sys.argv[1], device="cpu", warmup=False, kv_cache_memory_mb=256, threads=threads))
params = SamplingParams(max_tokens=400, temperature=0.0, ignore_eos=True)


def decode_step_ms(n: int = 60) -> float:
    eng.add_request(list(range(5, 69)), params)
    while not any(s.output_token_ids for s in eng.scheduler.running):
        eng.step()
    times = []
    for _ in range(n):
        t0 = time.perf_counter()
        eng.step()
        times.append(time.perf_counter() - t0)
    for rid in list(eng.requests):
        eng.abort(rid)
    return statistics.median(times[5:]) * 1e3


eager_before = decode_step_ms()
eager_forward = eng.model.forward
eng.model.forward = torch.compile(eager_forward, dynamic=True)
t0 = time.perf_counter()
decode_step_ms(8)
compile_s = time.perf_counter() - t0
compiled = decode_step_ms()
eng.model.forward = eager_forward
eager_after = decode_step_ms()
print(f"{sys.argv[1]} ({eng.dtype}, {threads} threads): eager {eager_before:.1f} / {eager_after:.1f} ms per step, "
      f"compiled {compiled:.1f} ms ({statistics.mean([eager_before, eager_after]) / compiled:.2f}x eager); "
      f"compiling took {compile_s:.0f} s")
