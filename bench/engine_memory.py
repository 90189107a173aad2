"""An engine's weights and the process's resident memory after a short generation, once per
``gguf_weights`` choice, each in a fresh process (so one's pages do not count for the other).

    .venv/bin/python bench/engine_memory.py models/default [blocks,dequantize]
"""

import subprocess
import sys

CHILD = r"""
import sys
from sits.engine.config import EngineConfig
from sits.engine.llm_engine import LLMEngine
from sits.engine.quantization import weight_bytes
from sits.engine.sampling_params import SamplingParams
eng = LLMEngine(EngineConfig(model=sys.argv[1], device="cpu", dtype="float32", warmup=False, kv_cache_memory_mb=64,
                             gguf_weights=sys.argv[2]))
eng.generate(["Hello there, how are you today?"], SamplingParams(max_tokens=16, temperature=0.0))
rss = int(open("/proc/self/status").read().split("VmRSS:")[1].split()[0]) // 1024
print(f"| {sys.argv[2]} | {weight_bytes(eng.model) / 2**20:.0f} | {rss} |")
"""


def main(model: str, choices: str = "blocks,dequantize") -> None:
    print("| gguf_weights | weights MiB | process RSS MiB |\n|---|---|---|")
    for choice in choices.split(","):
        out = subprocess.run([sys.executable, "-c", CHILD, model, choice], capture_output=True, text=True, check=True)
        print(out.stdout.strip().splitlines()[-1], flush=True)


if __name__ == "__main__":
    main(*sys.argv[1:3])
