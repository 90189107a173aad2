"""The C++ decoder-layer operators (``cpu_kernels.rms_norm``, ``rope_store_kv``) against the model's
torch code, and the engine serving through them (``elementwise="cpp"``) against the reference."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from sits.engine.models.llama import RMSNorm, apply_rope
from conftest import dense_greedy, greedy_mixed, require_cpu_kernel


@pytest.fixture(scope="module")
def kernel():
    return require_cpu_kernel()


@pytest.mark.parametrize("rows", [1, 7, 300])
@pytest.mark.parametrize("dim", [37, 576])
def test_rms_norm_equals_torch_and_adds_the_residual_in_place(kernel, rows, dim):
    g = torch.Generator().manual_seed(rows + dim)
    x, w = torch.randn(rows, dim, generator=g) * 3, torch.randn(dim, generator=g)
    torch.testing.assert_close(kernel.rms_norm(x, w, 1e-5), F.rms_norm(x, (dim,), w, 1e-5))
    residual = torch.randn(rows, dim, generator=g)
    h = residual + x
    out = kernel.rms_norm(x, w, 1e-6, residual)
    assert torch.equal(residual, h)                      # the same fp32 adds
    torch.testing.assert_close(out, F.rms_norm(h, (dim,), w, 1e-6))


def test_norm_with_residual_is_the_same_through_either_path(kernel):
    g = torch.Generator().manual_seed(5)
    norm = RMSNorm(24, 1e-5)
    norm.weight.data = torch.randn(24, generator=g)
    x, r = torch.randn(3, 24, generator=g), torch.randn(3, 24, generator=g)
    with torch.inference_mode():
        want, want_h = norm.with_residual(x, r.clone())
        first, first_h = norm.with_residual(x, None)
        norm.cpu_kernel = True
        got, got_h = norm.with_residual(x, r.clone())
        torch.testing.assert_close(got, want)
        assert torch.equal(got_h, want_h)
        k_first, k_first_h = norm.with_residual(x, None)
        torch.testing.assert_close(k_first, first)
        assert k_first_h is x and first_h is x


@pytest.mark.parametrize("tokens, heads, kv_heads, dim", [(1, 9, 3, 64), (5, 4, 4, 16), (33, 8, 2, 32)])
@pytest.mark.parametrize("fused", [False, True])
def test_rope_and_store_equal_the_model_code(kernel, tokens, heads, kv_heads, dim, fused):
    g = torch.Generator().manual_seed(tokens * heads + dim)
    q_w, kv_w = heads * dim, kv_heads * dim
    if fused:       # views of one q|k|v projection output, as the merged linear gives them
        q, k, v = torch.randn(tokens, q_w + 2 * kv_w, generator=g).split((q_w, kv_w, kv_w), dim=-1)
    else:
        q, k, v = (torch.randn(tokens, w, generator=g) for w in (q_w, kv_w, kv_w))
    q, k, v = q.reshape(tokens, heads, dim), k.reshape(tokens, kv_heads, dim), v.reshape(tokens, kv_heads, dim)
    angles = torch.rand(tokens, dim // 2, generator=g) * 6
    cos, sin = torch.cat([angles.cos()] * 2, -1), torch.cat([angles.sin()] * 2, -1)
    num_blocks, block_size = 13, 4
    slots = torch.randperm(num_blocks * block_size, generator=g)[:tokens]
    want_q, want_k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
    want_cache = torch.zeros(2, num_blocks * block_size, kv_heads, dim)
    want_cache[0].index_copy_(0, slots, want_k)
    want_cache[1].index_copy_(0, slots, v)
    cache = torch.zeros(2, num_blocks, block_size, kv_heads, dim)
    kernel.rope_store_kv(q, k, v, cos, sin, cache[0], cache[1], slots)
    torch.testing.assert_close(q, want_q)
    torch.testing.assert_close(k, want_k)
    torch.testing.assert_close(cache.view(2, -1, kv_heads, dim), want_cache)


def test_rope_store_refuses_slots_outside_the_cache_and_bad_shapes(kernel):
    q, k, v = torch.randn(2, 4, 8), torch.randn(2, 2, 8), torch.randn(2, 2, 8)
    cos, sin = torch.randn(2, 8), torch.randn(2, 8)
    cache = torch.zeros(2, 3, 4, 2, 8)
    with pytest.raises(RuntimeError, match="slot out of the cache"):
        kernel.rope_store_kv(q, k, v, cos, sin, cache[0], cache[1], torch.tensor([0, 12]))
    with pytest.raises(RuntimeError, match="slot out of the cache"):
        kernel.rope_store_kv(q, k, v, cos, sin, cache[0], cache[1], torch.tensor([-1, 0]))
    with pytest.raises(RuntimeError, match="cos and sin"):
        kernel.rope_store_kv(q, k, v, cos[:1], sin, cache[0], cache[1], torch.tensor([0, 1]))
    with pytest.raises(RuntimeError, match="fp32"):
        kernel.rope_store_kv(q.bfloat16(), k, v, cos, sin, cache[0], cache[1], torch.tensor([0, 1]))
    with pytest.raises(RuntimeError, match="heads"):
        kernel.rope_store_kv(q, k[:, :1], v, cos, sin, cache[0], cache[1], torch.tensor([0, 1]))
    with pytest.raises(RuntimeError, match="weight"):
        kernel.rms_norm(torch.randn(2, 8), torch.randn(7), 1e-5)


@pytest.mark.parametrize("linear", ["torch", "cpp"])
def test_engine_serves_through_the_decoder_ops_as_the_reference_does(kernel, make_engine, linear):
    g = torch.Generator().manual_seed(13)
    prompts = [torch.randint(5, 200, (n,), generator=g).tolist() for n in (3, 29, 11, 50, 1)]
    cpp = make_engine(elementwise="cpp", linear=linear, dtype="float32", block_size=4, max_num_batched_tokens=16)
    ref = make_engine(elementwise="torch", linear="torch", attention="torch", dtype="float32", block_size=4,
                      max_num_batched_tokens=16)
    assert (cpp.elementwise, ref.elementwise) == ("cpp", "torch")
    outs = [greedy_mixed(eng, prompts, 24) for eng in (cpp, ref)]   # prefill chunks beside decodes
    assert outs[0] == outs[1]
    assert outs[0][1] == dense_greedy(ref, prompts[1], 24)
