"""Decode-step time of two checkouts of SITS on the same model, in separate processes taking turns
(order reversed every round), medians of 3 rounds (or ROUNDS): old vs new code in the same run.

    git worktree add /tmp/old HEAD~1
    .venv/bin/python bench/decode_code_ab.py MODEL_DIR DTYPE /tmp/old . [ROUNDS] [STREAMSxPROMPT,...]

Per checkout: ms per decode step at 1, 8 and 32 streams with 16-token prompts, and 32 streams with
256-token prompts (attention over a longer context), or the streams x prompts given.
"""

import os
import sys

from ab import alternate, medians

CHILD = r"""
import json, statistics, sys, time
from sits.engine.config import EngineConfig
from sits.engine.llm_engine import LLMEngine
from sits.engine.sampling_params import SamplingParams
eng = LLMEngine(EngineConfig(model=sys.argv[1], device="cpu", dtype=sys.argv[2], warmup=False, kv_cache_memory_mb=256))
vocab = eng.model_config.vocab_size
def run(n, plen, steps=24):
    for s in range(n):
        eng.add_request([(s * 31 + i * 7) % (vocab - 10) + 5 for i in range(plen)],
                        SamplingParams(max_tokens=steps + 1, temperature=0.0, ignore_eos=True))
    eng.step()
    t, k = time.perf_counter(), 0
    while eng.has_unfinished:
        eng.step()
        k += 1
    return (time.perf_counter() - t) / k * 1e3
run(1, 16, 4)
shapes = sys.argv[3] if len(sys.argv) > 3 else "1x16,8x16,32x16,32x256"
print(json.dumps({key: statistics.median(run(*map(int, key.split("x"))) for _ in range(2))
                  for key in shapes.split(",")}))
"""


def main(model: str, dtype: str, old: str, new: str, rounds: int = 3, shapes: str | None = None) -> None:
    args = [os.path.abspath(model), dtype] + ([shapes] if shapes else [])
    med = medians(alternate(CHILD, args, old, new, rounds))
    print("| streams x prompt | old ms/step | new ms/step | speed-up |\n|---|---|---|---|")
    for key, a in med["old"].items():
        b = med["new"][key]
        print(f"| {key} | {a:.1f} | {b:.1f} | {a / b:.2f}× |")


if __name__ == "__main__":
    main(*sys.argv[1:5], *map(int, sys.argv[5:6]), *sys.argv[6:7])
