"""The block kernels of another revision against this checkout's, inside one engine: both builds'
``block_linear``/``block_dequantize`` loaded into one process and swapped every 8 decode steps of
one stream (turns reversed every round), medians of the rounds. Separates a kernel's speed from the
noise between processes that an old-vs-new run of whole checkouts carries.

    .venv/bin/python bench/block_kernel_ab.py 794bd58 models/default [ROUNDS]

The revision's ``csrc`` is built for this machine into a temporary directory (a minute).
"""

import statistics
import subprocess
import sys
import tempfile
import time
import types
from pathlib import Path

from sits.engine.config import EngineConfig
from sits.engine.layers import block_quant, cpu_kernels
from sits.engine.llm_engine import LLMEngine
from sits.engine.sampling_params import SamplingParams

def old_block_kernels(rev: str, directory: Path):
    """``rev``'s block kernels, compiled with the flags of ``cpu_kernels``."""
    root = Path(__file__).resolve().parents[1]
    src = directory / "csrc"
    src.mkdir()
    rel = cpu_kernels.CSRC.relative_to(root)
    for name in ("block_quant_cpu.cpp", "few_rows.h", "vec.h"):
        text = subprocess.run(["git", "-C", str(root), "show", f"{rev}:{rel / name}"], capture_output=True,
                              text=True, check=True).stdout
        (src / name).write_text(text)
    print(f"building {rev}'s block kernels", file=sys.stderr, flush=True)
    int8 = "block_linear_int8" in (src / "block_quant_cpu.cpp").read_text()
    return cpu_kernels.build_block_kernels(f"block_kernels_{rev}", src, directory, int8=int8)


def main(rev: str, model: str, rounds: int = 30) -> None:
    new = cpu_kernels.kernel(build=False)
    if new is None:
        raise SystemExit("the CPU kernels are not built (make install)")
    with tempfile.TemporaryDirectory() as tmp:
        old = old_block_kernels(rev, Path(tmp))
    kernels = {rev: old, "this checkout": new}
    turn = {"k": new}
    block_quant.cpu_kernels = types.SimpleNamespace(loaded=lambda: turn["k"])
    eng = LLMEngine(EngineConfig(model=model, device="cpu", dtype="float32", warmup=False, kv_cache_memory_mb=128))
    eng.add_request(list(range(5, 21)), SamplingParams(max_tokens=16 * rounds + 8, temperature=0.0, ignore_eos=True))
    eng.step()
    eng.step()
    times: dict[str, list[float]] = {k: [] for k in kernels}
    for r in range(rounds):
        for name in (list(kernels) if r % 2 == 0 else list(kernels)[::-1]):
            turn["k"] = kernels[name]
            t0 = time.perf_counter()
            for _ in range(8):
                eng.step()
            times[name].append((time.perf_counter() - t0) / 8 * 1e3)
    print("| block kernels | ms per step (median) | min |\n|---|---|---|")
    for name, ts in times.items():
        print(f"| {name} | {statistics.median(ts):.2f} | {min(ts):.2f} |")


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], *map(int, sys.argv[3:4]))
