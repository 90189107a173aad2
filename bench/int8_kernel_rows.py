"""Where the int8 weight kernel stops paying: per matmul on SmolLM2-135M's projection shapes, the
time of ``torch._weight_int8pack_mm`` vs dequantizing the weight for a bf16 matmul vs bf16 weights,
by rows of activations (a decode step's rows = its streams). Sets ``INT8_KERNEL_MAX_ROWS``
(sits/engine/quantization.py); results in docs/benchmarks.md.

    .venv/bin/python bench/int8_kernel_rows.py [rows ...]
"""

import statistics
import sys
import time

import torch
import torch.nn.functional as F

from sits.engine.host_memory import keep_step_buffers_in_heap

SHAPES = [(576, 576), (192, 576), (1536, 576), (576, 1536)]   # q/o, k/v, gate/up, down (out, in)


def timed(fn, n: int = 200) -> float:
    for _ in range(10):
        fn()
    runs = []
    for _ in range(5):
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        runs.append((time.perf_counter() - t0) / n * 1e6)
    return statistics.median(runs)


def main(rows: list[int]) -> None:
    torch.set_num_threads(2)
    keep_step_buffers_in_heap()     # as a CPU engine runs (a per-call dequantized weight stays on the heap)
    print("rows | bf16 µs | int8 kernel µs | dequantize + bf16 µs   (sum over the four shapes)")
    for m in rows:
        tot = {"bf16": 0.0, "int8": 0.0, "dequant": 0.0}
        for out, inp in SHAPES:
            w = torch.randn(out, inp, dtype=torch.bfloat16)
            x = torch.randn(m, inp, dtype=torch.bfloat16)
            q = torch.randint(-127, 127, (out, inp), dtype=torch.int8)
            s = torch.rand(out, dtype=torch.bfloat16)
            tot["bf16"] += timed(lambda: F.linear(x, w))
            tot["int8"] += timed(lambda: torch._weight_int8pack_mm(x, q, s))
            tot["dequant"] += timed(lambda: F.linear(x, q.to(torch.bfloat16) * s[:, None]))
        print(f"{m:4d} | {tot['bf16']:7.1f} | {tot['int8']:14.1f} | {tot['dequant']:10.1f}")


if __name__ == "__main__":
    main([int(a) for a in sys.argv[1:]] or [1, 4, 8, 16, 24, 32, 64])
