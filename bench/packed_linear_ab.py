"""Plain vs pre-packed (and q/k/v, gate/up merged) bf16 linears in one process, decode steps at 1, 8
and 32 streams, the two engines taking turns (order reversed every round), medians of 4 rounds.

    .venv/bin/python bench/packed_linear_ab.py MODEL_DIR bfloat16

``sits bench dtype --dtypes bfloat16+plain,bfloat16`` measures the same in separate processes.
"""
import time, statistics, sys
from sits.engine.config import EngineConfig
from sits.engine.llm_engine import LLMEngine
from sits.engine.sampling_params import SamplingParams
model, dtype = sys.argv[1], sys.argv[2]
engines = {"plain": LLMEngine(EngineConfig(model=model, device="cpu", dtype=dtype, warmup=False, kv_cache_memory_mb=256, pack_weights=False)),
           "packed+fused": LLMEngine(EngineConfig(model=model, device="cpu", dtype=dtype, warmup=False, kv_cache_memory_mb=256))}
def run(eng, n_seqs, steps=24):
    V = eng.model_config.vocab_size
    for s in range(n_seqs):
        eng.add_request([(s * 31 + i * 7) % (V - 10) + 5 for i in range(16)],
                        SamplingParams(max_tokens=steps + 1, temperature=0.0, ignore_eos=True))
    eng.step()
    t = time.perf_counter(); k = 0
    while eng.has_unfinished:
        eng.step(); k += 1
    return (time.perf_counter() - t) / k * 1e3
res = {(n, name): [] for n in (1, 8, 32) for name in engines}
for r in range(4):
    for n in (1, 8, 32):
        for name in (list(engines) if r % 2 == 0 else list(reversed(engines))):
            res[(n, name)].append(run(engines[name], n))
for n in (1, 8, 32):
    a, b = statistics.median(res[(n, "plain")]), statistics.median(res[(n, "packed+fused")])
    print(f"{model} {dtype} streams {n}: plain {a:.2f} ms/step, packed+fused {b:.2f} ms/step, speed-up {a / b:.2f}x")
