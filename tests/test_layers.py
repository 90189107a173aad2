"""The layers' kernel choices compute the same attention as the reference call."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from sits.engine.layers.attention import decode_attention


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("heads, kv_heads", [(9, 3), (4, 2), (4, 4)])
def test_decode_attention_equals_sdpa_with_gqa(dtype, heads, kv_heads):
    g = torch.Generator().manual_seed(0)
    b, length, dim = 5, 37, 16
    q = torch.randn(b, heads, 1, dim, generator=g).to(dtype)
    k, v = (torch.randn(b, kv_heads, length, dim, generator=g).to(dtype) for _ in range(2))
    lens = torch.tensor([37, 1, 20, 36, 9])
    mask = (torch.arange(length)[None, :] < lens[:, None])[:, None, None, :]
    ref = F.scaled_dot_product_attention(q.float(), k.float(), v.float(), attn_mask=mask,
                                         enable_gqa=heads != kv_heads)
    got = decode_attention(q, k, v, mask)
    assert got.shape == (b, heads, 1, dim) and got.dtype == dtype
    tol = 1e-6 if dtype == torch.float32 else 2e-2
    assert (got.float() - ref).abs().max().item() <= tol
    if dtype == torch.float32:          # fp32 keeps the reference call itself
        assert torch.equal(got, F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=heads != kv_heads))
