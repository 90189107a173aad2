"""One pass over a GGUF model's linears (its own weights, q/k/v and gate/up fused as served) at 1 to
64 rows, three ways, taking turns: the file's blocks through the C++ block kernel
(``cpu_kernels.block_linear``), the blocks expanded to fp32 and multiplied by torch's matmul (what
``BlockLinear`` does above ``KERNEL_MAX_ROWS``), and the weights dequantized at load through the fp32
``Linear`` (few-row kernel up to 16 rows, split ``bmm`` up to 128: what ``gguf_weights: dequantize``
serves). Min of 2 medians of 7 passes each. Shows what the blocks gain per decode row count and where
the expanded matmul overtakes the block kernel (``KERNEL_MAX_ROWS``).

    .venv/bin/python bench/block_linear_rows.py models/default [ROWS,...]
"""

import sys

import torch

from sits.engine.config import ModelConfig
from sits.engine.layers import block_quant, cpu_kernels
from sits.engine.layers.block_quant import BlockLinear
from sits.engine.layers.linear import Linear, split_linears, use_cpu_kernel
from sits.engine.loader import load_model
from split_linear_rows import _ms


def _linears(model) -> list:
    out = []
    for layer in model.model.layers:
        a, m = layer.self_attn, layer.mlp
        out += [a.qkv_proj or a.q_proj, a.o_proj, m.gate_up_proj or m.gate_proj, m.down_proj]
    return out + [model.lm_head]


def main(path: str, rows_list: str = "1,2,4,8,16,24,32,64") -> None:
    block_quant.KERNEL_MAX_ROWS = 0          # BlockLinear always expands slices; the kernel is called directly
    kernels = cpu_kernels.kernel(build=False)
    if kernels is None:
        raise SystemExit("the CPU kernels are not built (make install)")
    mc = ModelConfig.from_dir(path)
    cpu = torch.device("cpu")
    blocks_model = load_model(path, mc, cpu, torch.float32, 256, gguf_blocks=True)
    dense_model = load_model(path, mc, cpu, torch.float32, 256)
    for m in (blocks_model, dense_model):
        m.fuse_projections()
    split_linears(dense_model)
    use_cpu_kernel(dense_model, True)
    blocks, dense = _linears(blocks_model), _linears(dense_model)
    assert all(isinstance(b, BlockLinear) for b in blocks) and all(isinstance(d, Linear) for d in dense)
    kinds = sorted({b.qtype for b in blocks})
    print(f"{path}: blocks ({', '.join(kinds)}) {sum(b.blocks.numel() for b in blocks) / 1e6:.0f} MB, dequantized "
          f"{sum(d.weight.numel() * 4 for d in dense) / 1e6:.0f} MB, {torch.get_num_threads()} threads")
    print("| rows | block kernel ms | expanded + matmul ms | dequantized at load ms | blocks vs dequantized | "
          "kernel vs expanded |\n|---|---|---|---|---|---|")
    with torch.inference_mode():
        for rows in map(int, rows_list.split(",")):
            xs = [torch.randn(rows, b.in_features) for b in blocks]
            variants = {
                "kernel": lambda: [kernels.block_linear(x, b.blocks, b.type_id, b.in_features) for x, b in zip(xs, blocks)],
                "expanded": lambda: [b(x) for x, b in zip(xs, blocks)],     # KERNEL_MAX_ROWS is 0 here
                "dense": lambda: [d(x) for x, d in zip(xs, dense)],
            }
            runs: dict[str, list[float]] = {name: [] for name in variants}
            for _ in range(2):
                for name, fn in variants.items():
                    runs[name].append(_ms(fn))
            best = {name: min(times) for name, times in runs.items()}
            fastest_blocks = min(best["kernel"], best["expanded"])
            print(f"| {rows} | {best['kernel']:.1f} | {best['expanded']:.1f} | {best['dense']:.1f} | "
                  f"{best['dense'] / fastest_blocks:.2f}× | {best['expanded'] / best['kernel']:.2f}× |")


if __name__ == "__main__":
    main(*sys.argv[1:3])
