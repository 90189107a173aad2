"""The block kernels with fp32 and with 8-bit activations, per block type, on random blocks of one
weight shape: ms per call (medians, the two taking turns) and the int8 output's relative error.

    .venv/bin/python bench/block_int8_rows.py [OUT IN] [TYPES] [ROWS]
    .venv/bin/python bench/block_int8_rows.py 2048 2048 Q4_1,Q4_K 1,4,16
"""

from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

import gguf  # noqa: E402
from gguf import GGMLQuantizationType as Q  # noqa: E402
from gguf_writer_util import K_QUANTS, random_kquant  # noqa: E402

from sits.engine.layers import cpu_kernels  # noqa: E402
from sits.engine.layers.block_quant import BLOCK_TYPES  # noqa: E402


def main(out_f: int = 2048, in_f: int = 2048, types: str = ",".join(BLOCK_TYPES), rows: str = "1,4,16") -> None:
    kernels = cpu_kernels.kernel()
    rng = np.random.default_rng(0)
    print(f"Weight {out_f} x {in_f}, {torch.get_num_threads()} threads\n")
    print("| type | rows | fp32 ms | int8 ms | speed-up | int8 relative error |\n|---|---|---|---|---|---|")
    for name in types.split(","):
        qt = Q[name]
        raw = (random_kquant(out_f, in_f, qt, rng) if qt in K_QUANTS else
               gguf.quants.quantize(rng.standard_normal((out_f, in_f)).astype(np.float32) * 0.05, qt))
        blocks, type_id = torch.from_numpy(raw.copy()), BLOCK_TYPES[name][0]
        for m in (int(r) for r in rows.split(",")):
            x = torch.randn(m, in_f)
            ref = kernels.block_linear(x, blocks, type_id, in_f)
            err = ((kernels.block_linear_int8(x, blocks, type_id, in_f) - ref).norm() / ref.norm()).item()
            times = {"fp32": [], "int8": []}
            for _ in range(15):
                for key, f in (("fp32", kernels.block_linear), ("int8", kernels.block_linear_int8)):
                    t = time.perf_counter()
                    f(x, blocks, type_id, in_f)
                    times[key].append(time.perf_counter() - t)
            a, b = (statistics.median(times[k]) * 1e3 for k in ("fp32", "int8"))
            print(f"| {name} | {m} | {a:.3f} | {b:.3f} | {a / b:.2f}× | {err:.1e} |", flush=True)


if __name__ == "__main__":
    args = sys.argv[1:]
    main(*(int(a) for a in args[:2]), *args[2:])
