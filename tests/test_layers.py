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


@pytest.fixture
def threads():
    before = torch.get_num_threads()
    yield torch.set_num_threads
    torch.set_num_threads(before)


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("ways", [2, 4])
@pytest.mark.parametrize("shape", [(1, 96), (3, 96), (128, 96), (2, 5, 96), (129, 96)])
def test_split_linear_equals_f_linear(threads, ways, shape, bias):
    from sits.engine.layers.linear import Linear, split_linears

    g = torch.Generator().manual_seed(1)
    layer = Linear(96, 64, bias=bias)
    layer.weight = torch.nn.Parameter(torch.randn(64, 96, generator=g), requires_grad=False)
    if bias:
        layer.bias = torch.nn.Parameter(torch.randn(64, generator=g), requires_grad=False)
    assert split_linears(layer) == 1 and layer.split
    threads(ways)
    x = torch.randn(*shape, generator=g)
    with torch.inference_mode():
        got = layer(x)
    assert got.shape == (*shape[:-1], 64)
    torch.testing.assert_close(got, F.linear(x, layer.weight, layer.bias), rtol=1e-6, atol=1e-5)


def test_split_linear_follows_a_new_weight_and_uneven_rows(threads):
    from sits.engine.layers.linear import Linear, split_linears

    g = torch.Generator().manual_seed(2)
    layer = Linear(32, 6)
    layer.weight = torch.nn.Parameter(torch.randn(6, 32, generator=g), requires_grad=False)
    split_linears(layer)
    x = torch.randn(1, 32, generator=g)

    def check():
        torch.testing.assert_close(layer(x), F.linear(x, layer.weight), rtol=1e-6, atol=1e-5)

    threads(2)
    check()
    layer.weight = torch.nn.Parameter(torch.randn(6, 32, generator=g), requires_grad=False)
    check()                                        # not the old weight's kept blocks
    layer.weight.data = torch.randn(6, 32, generator=g)
    check()                                        # nor the old storage's
    threads(4)                                     # 6 rows: 3 blocks, the most up to 4 that divide them
    check()
    assert layer._blocks[2] == 3


def test_split_linear_leaves_a_training_weight_to_f_linear(threads):
    from sits.engine.layers.linear import Linear, split_linears

    g = torch.Generator().manual_seed(3)
    layer = Linear(16, 8)
    layer.weight = torch.nn.Parameter(torch.randn(8, 16, generator=g))
    split_linears(layer)
    threads(2)
    layer(torch.randn(2, 16, generator=g)).sum().backward()
    assert layer.weight.grad is not None and layer._blocks is None


@pytest.mark.skipif(len(__import__("os").sched_getaffinity(0)) < 2, reason="one core: nothing to split over")
def test_cpu_fp32_engine_splits_its_linears(tiny_model_dir):
    from sits.engine.config import EngineConfig
    from sits.engine.layers.linear import Linear
    from sits.engine.llm_engine import LLMEngine

    eng = LLMEngine(EngineConfig(model=tiny_model_dir, device="cpu", dtype="float32", warmup=False,
                                 kv_cache_memory_mb=8))
    linears = [m for m in eng.model.modules() if isinstance(m, Linear)]
    assert linears and all(m.split for m in linears)


def test_projections_merge_only_where_the_weights_are_copied(tiny_model_dir):
    """fp32 weights mapped from the file stay its views (merging would copy them); weights converted
    at load are this process's own memory already, so their q/k/v and gate/up are merged."""
    from sits.engine.config import EngineConfig
    from sits.engine.llm_engine import LLMEngine

    def engine(dtype):
        return LLMEngine(EngineConfig(model=tiny_model_dir, device="cpu", dtype=dtype, warmup=False,
                                      kv_cache_memory_mb=8))

    mapped, converted = engine("float32"), engine("float16")
    assert all(layer.self_attn.qkv_proj is None for layer in mapped.model.model.layers)
    assert all(layer.self_attn.qkv_proj is not None and layer.mlp.gate_up_proj is not None
               for layer in converted.model.model.layers)     # (GGUF's dequantized weights too: test_gguf's parity)
