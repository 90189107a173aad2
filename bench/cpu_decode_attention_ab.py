"""The CPU decode-attention kernel (``layers.cpu_attention``) against the reference path's gather +
SDPA, on a random paged cache with scattered blocks, in one process, the two calls taking turns.

    .venv/bin/python bench/cpu_decode_attention_ab.py [ROUNDS]

Per shape (sequences, query/KV heads, context, dtype, window): µs per call of each (median of ROUNDS
medians of 20 calls) and the largest difference between their outputs.
"""

import statistics
import sys
import time

import torch

from sits.engine.layers import cpu_attention, cpu_kernels
from sits.engine.layers.attention import decode_attention

SHAPES = [  # batch, heads, kv_heads, context, dtype, window
    (1, 8, 4, 24, torch.float32, None),       # small, one stream
    (1, 9, 3, 24, torch.float32, None),       # SmolLM2, one stream
    (1, 9, 3, 1000, torch.float32, None),
    (8, 9, 3, 24, torch.float32, None),
    (32, 8, 4, 272, torch.float32, None),
    (32, 9, 3, 272, torch.float32, None),
    (32, 8, 4, 272, torch.float32, 100),
    (32, 8, 4, 272, torch.bfloat16, None),
]


def case(batch, heads, kv_heads, context, dtype, window, rounds, dim=64, block_size=16, num_blocks=1200):
    g = torch.Generator().manual_seed(0)
    kv = torch.randn(2, num_blocks, block_size, kv_heads, dim, generator=g).to(dtype)
    width = -(-context // block_size)
    tables = torch.randperm(num_blocks, generator=g)[:batch * width].view(batch, width)
    lens = torch.randint(context - 10, context + 1, (batch,), generator=g).clamp(min=1)
    q = torch.randn(batch, heads, dim, generator=g).to(dtype)
    k_pos = torch.arange(width * block_size)[None, :]
    mask = k_pos < lens[:, None]
    if window:
        mask &= k_pos >= lens[:, None] - window
    mask = mask[:, None, None, :]

    def reference():
        kvg = kv.flatten(2).index_select(1, tables.view(-1)).view(2, batch, -1, kv_heads, dim).transpose(2, 3)
        return decode_attention(q.unsqueeze(2), kvg[0], kvg[1], mask).squeeze(2)

    def kernel():
        return cpu_attention.paged_decode(q, kv, tables, lens, dim ** -0.5, window)

    diff = (reference().float() - kernel().float()).abs().max().item()
    times = {"reference": [], "kernel": []}
    for r in range(rounds):
        for name, f in (("reference", reference), ("kernel", kernel))[::1 if r % 2 == 0 else -1]:
            t = time.perf_counter()
            for _ in range(20):
                f()
            times[name].append((time.perf_counter() - t) / 20 * 1e6)
    ref, ker = (statistics.median(times[k]) for k in ("reference", "kernel"))
    name = str(dtype).removeprefix("torch.")
    print(f"| {batch} | {heads}/{kv_heads} | {context} | {name} | {window or '–'} | {ref:.0f} | {ker:.0f} | "
          f"{ref / ker:.2f}× | {diff:.1e} |", flush=True)


def main(rounds: int = 7) -> None:
    if cpu_kernels.kernel() is None:
        sys.exit(f"the kernel is not available: {cpu_kernels.kernel_error()}")
    print(f"{torch.get_num_threads()} threads\n")
    print("| sequences | heads (q/kv) | context | dtype | window | gather + SDPA µs | kernel µs | speed-up | max diff |")
    print("|---|---|---|---|---|---|---|---|---|")
    for shape in SHAPES:
        case(*shape, rounds=rounds)


if __name__ == "__main__":
    main(*map(int, sys.argv[1:2]))
