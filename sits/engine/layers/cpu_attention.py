"""Decode attention that reads the paged KV cache in place on a CPU (a C++ kernel of ``cpu_kernels``).

The reference path (``models/llama.py``) gathers every decoding sequence's blocks into a padded copy
for each layer of each step and runs SDPA over that copy: on a CPU the copy and the second read of it
cost more than the attention itself. ``csrc/paged_decode_cpu.cpp`` walks each sequence's block table
and reads every cached K/V row once, where it lies: one task per sequence (the row of all KV heads
read whole), or per (sequence, KV head) when there are fewer sequences than threads; fp32 scores
and softmax whatever the cache's dtype.
"""

from __future__ import annotations

import torch

from sits.engine.layers import cpu_kernels


def paged_decode(q: torch.Tensor, kv_cache: torch.Tensor, block_tables: torch.Tensor,
                 context_lens: torch.Tensor, scale: float, window: int | None) -> torch.Tensor:
    """q: [B, H, D] one query per sequence; kv_cache: [2, num_blocks, block_size, H_kv, D];
    block_tables: [B, W] int64; context_lens: [B] int64 (the new token included) -> [B, H, D]."""
    return cpu_kernels.loaded().paged_decode_attention(q, kv_cache, block_tables, context_lens, scale, window or 0)
