"""A decode step's linears, one pass over a whole model's projections (random weights of its shapes),
at 1 to 32 rows: ``F.linear`` vs ``layers.linear.split_matmul`` (one bmm over a column block per
intra-op thread) vs oneDNN with the weights pre-packed vs the C++ few-row kernel (``cpu_kernels``,
where it is built); min of 2 medians of 7 passes each, variants taking turns. Shows whether this
CPU's BLAS threads a few-row matmul by itself, and up to how many rows the kernel pays.

    .venv/bin/python bench/split_linear_rows.py small|smollm2 [ROWS,...]
"""

import statistics
import sys
import time

import torch
import torch.nn.functional as F

from sits.engine.layers import cpu_kernels
from sits.engine.layers.linear import split_matmul, weight_blocks

SHAPES = {"small": (512, 1408, 8192, 8, 256), "smollm2": (576, 1536, 49152, 30, 192)}


def _ms(fn, passes: int = 7) -> float:
    fn()
    times = []
    for _ in range(passes):
        start = time.perf_counter()
        fn()
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def main(model: str, rows_list: str = "1,8,32") -> None:
    hidden, inter, vocab, layers, kv = SHAPES[model]
    shapes = [(hidden + 2 * kv, hidden), (hidden, hidden), (inter, hidden), (inter, hidden), (hidden, inter)] * layers
    weights = [torch.randn(o, i) for o, i in shapes + [(vocab, hidden)]]
    ways = torch.get_num_threads()
    blocks = [weight_blocks(w, ways) for w in weights]
    packed = [torch.ops.mkldnn._reorder_linear_weight(w, 1) for w in weights]
    print(f"{model}: {sum(w.numel() for w in weights) * 4 / 1e6:.0f} MB of fp32 weights, {ways} threads")
    kernels = cpu_kernels.kernel(build=False)
    print("| rows | F.linear ms | split ms | oneDNN packed ms | C++ kernel ms | split speed-up | kernel vs split |\n"
          "|---|---|---|---|---|---|---|")
    with torch.inference_mode():
        for rows in map(int, rows_list.split(",")):
            xs = [torch.randn(rows, w.shape[1]) for w in weights]
            variants = {
                "linear": lambda: [F.linear(x, w) for x, w in zip(xs, weights)],
                "split": lambda: [split_matmul(x, w, None, ways, b) for x, w, b in zip(xs, weights, blocks)],
                "onednn": lambda: [torch.ops.mkldnn._linear_pointwise(x, p, None, "none", [], "")
                                   for x, p in zip(xs, packed)],
            }
            if kernels is not None:
                variants["kernel"] = lambda: [kernels.few_rows_linear(x, w) for x, w in zip(xs, weights)]
            runs: dict[str, list[float]] = {name: [] for name in variants}
            for _ in range(2):
                for name, fn in variants.items():
                    runs[name].append(_ms(fn))
            best = {name: min(times) for name, times in runs.items()}
            kernel = best.get("kernel", float("nan"))
            print(f"| {rows} | {best['linear']:.1f} | {best['split']:.1f} | {best['onednn']:.1f} | {kernel:.1f} | "
                  f"{best['linear'] / best['split']:.2f}× | {best['split'] / kernel:.2f}× |")


if __name__ == "__main__":
    main(*sys.argv[1:3])
