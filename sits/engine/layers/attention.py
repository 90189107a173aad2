"""Attention kernels the model's layers call, chosen per call by what measures faster here.

Decode (one query per sequence) with grouped-query attention: SDPA's ``enable_gqa`` path on a CPU
in bf16 takes up to 7× longer than the same attention posed with each KV head's group of query
heads as that head's queries (``[B, kv_heads, group, D]`` against ``[B, kv_heads, L, D]``; one
padding mask serves the whole group, as they sit at the same position). In fp32 the plain GQA call
is the faster one and is kept (figures in docs/benchmarks.md).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def decode_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    """q: [B, H, 1, D]; k, v: [B, H_kv, L, D]; mask: [B, 1, 1, L] bool (True: attend) -> [B, H, 1, D]."""
    b, heads, _, dim = q.shape
    kv_heads = k.shape[1]
    if heads != kv_heads and q.device.type == "cpu" and q.dtype != torch.float32:
        o = F.scaled_dot_product_attention(q.view(b, kv_heads, heads // kv_heads, dim), k, v, attn_mask=mask)
        return o.view(b, heads, 1, dim)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=heads != kv_heads)
