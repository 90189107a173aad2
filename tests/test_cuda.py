"""The engine on a CUDA device: the same code as on CPU, checked against the CPU and transformers.

Skipped where torch sees no GPU (CI, this project's development hosts). ``bench/device_check.sh``
runs this file on a GPU host together with the engine benchmark on the device. The checks
themselves run anywhere: ``SITS_TEST_DEVICE=cpu`` points them at the CPU (so they are known to pass
there before a GPU is at hand).
"""

from __future__ import annotations

import os

import pytest
import torch

from sits.engine.config import EngineConfig, ModelConfig
from sits.engine.llm_engine import LLMEngine
from sits.engine.loader import load_model
from sits.engine.sampling_params import SamplingParams

DEVICE = os.environ.get("SITS_TEST_DEVICE", "cuda")
if not DEVICE.startswith("cuda"):
    # the paged kernels then run in Triton's interpreter, which must be chosen before Triton is imported
    os.environ.setdefault("TRITON_INTERPRET", "1")
pytestmark = pytest.mark.skipif(DEVICE.startswith("cuda") and not torch.cuda.is_available(), reason="no CUDA device")


@pytest.fixture(autouse=True)
def _exact_fp32():
    """fp32 means fp32: TF32 matmuls would differ from the CPU by ~1e-3."""
    before = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = before


def test_weights_load_onto_the_device_and_logits_match_the_cpu(tiny_model_dir):
    cfg = ModelConfig.from_dir(tiny_model_dir)
    cpu = load_model(tiny_model_dir, cfg, torch.device("cpu"), torch.float32, 128)
    gpu = load_model(tiny_model_dir, cfg, torch.device(DEVICE), torch.float32, 128)
    assert all(p.device.type == torch.device(DEVICE).type for p in gpu.parameters())
    ids = torch.randint(5, cfg.vocab_size, (2, 64), generator=torch.Generator().manual_seed(1))
    with torch.inference_mode():
        ref = cpu.forward_dense(ids)
        got = gpu.forward_dense(ids.to(DEVICE)).cpu()
    assert (ref - got).abs().max().item() <= 1e-4


@pytest.mark.parametrize("variant", ["llama3-gqa-rope-scaling", "qwen2-qkv-bias"])
def test_dense_logits_on_cuda_match_transformers(tmp_path, variant):
    pytest.importorskip("transformers")
    from test_model_parity import _save_hf        # the CPU parity test's models, same seeds

    hf = _save_hf(tmp_path, variant)
    cfg = ModelConfig.from_dir(tmp_path)
    ours = load_model(tmp_path, cfg, torch.device(DEVICE), torch.float32, cfg.max_position_embeddings)
    ids = torch.randint(0, cfg.vocab_size, (2, 100), generator=torch.Generator().manual_seed(1))
    with torch.inference_mode():
        ref = hf(input_ids=ids).logits.float()
        got = ours.forward_dense(ids.to(DEVICE)).cpu()
    assert (ref - got).abs().max().item() <= 1e-4


def _engine(model: str, device: str, **kw) -> LLMEngine:
    """fp32 unless asked (``auto`` would be bf16 on a GPU and fp32 on this fp32 checkpoint's CPU)."""
    return LLMEngine(EngineConfig(model=model, device=device, **({"warmup": False, "num_kv_blocks": 128,
                                  "block_size": 16, "max_num_batched_tokens": 64, "dtype": "float32"} | kw)))


def test_paged_serving_path_on_cuda_gives_the_cpu_greedy_tokens(tiny_model_dir):
    """Chunked prefill through block tables, continuous batching, prefix reuse: same tokens as the CPU."""
    prompts = [torch.randint(5, 500, (n,), generator=torch.Generator().manual_seed(n)).tolist() for n in (7, 40, 90)]
    prompts.append(prompts[2][:80] + [11, 12, 13])          # shares five full blocks with the third
    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    cpu = _engine(tiny_model_dir, "cpu").generate(prompts, params)
    eng = _engine(tiny_model_dir, DEVICE)
    gpu = eng.generate(prompts, params)
    assert [r["token_ids"] for r in gpu] == [r["token_ids"] for r in cpu]
    st = eng.stats()
    assert st.prefix_hit_rate > 0 and st.num_free_blocks == st.num_kv_blocks
    assert all(t.device.type == torch.device(DEVICE).type for t in eng.kv_cache.layers)


def test_bfloat16_on_cuda_streams_and_frees_everything(tiny_model_dir):
    eng = _engine(tiny_model_dir, DEVICE, dtype="bfloat16")
    outs = eng.generate([[5, 6, 7, 8] * 8] * 4, SamplingParams(max_tokens=8, temperature=0.8, seed=3))
    assert all(len(o["token_ids"]) == 8 for o in outs)
    again = _engine(tiny_model_dir, DEVICE, dtype="bfloat16").generate(
        [[5, 6, 7, 8] * 8] * 4, SamplingParams(max_tokens=8, temperature=0.8, seed=3))
    assert [o["token_ids"] for o in again] == [o["token_ids"] for o in outs]     # seeded: reproducible
    st = eng.stats()
    assert st.num_free_blocks == st.num_kv_blocks


# -- the paged Triton kernels, decode graphs and sampling on the device ------------------------------
# On the CPU these run through Triton's interpreter (slow: the shapes are kept small).

@pytest.fixture
def triton_kernels():
    pytest.importorskip("triton")
    from sits.engine.layers import paged_attention

    assert paged_attention.available(torch.device(DEVICE))
    return paged_attention


def _paged_case(dtype, heads, kv_heads, dim, block_size, window, spans, seed=0):
    """A KV cache holding each sequence's cached keys in scattered blocks, this step's new K/V and
    queries, and the reference output: SDPA over each sequence's whole context, causal, windowed."""
    import torch.nn.functional as F
    from sits.engine.layers.paged_attention import PagedMetadata

    g = torch.Generator().manual_seed(seed)
    num_blocks = 64
    k_cache = torch.zeros(num_blocks, block_size, kv_heads, dim, dtype=dtype)
    v_cache = torch.zeros_like(k_cache)
    free = torch.randperm(num_blocks, generator=g).tolist()
    total = sum(n for _, n in spans)
    q = torch.randn(total, heads, dim, generator=g).to(dtype)
    k_new, v_new = (torch.randn(total, kv_heads, dim, generator=g).to(dtype) for _ in range(2))
    ref = torch.empty(total, heads, dim)
    tables, slots, cu, lens = [], [], [0], []
    for cached, n in spans:
        length, start = cached + n, cu[-1]
        table = [free.pop() for _ in range(-(-length // block_size))]
        k_all, v_all = (torch.randn(length, kv_heads, dim, generator=g).to(dtype) for _ in range(2))
        k_all[cached:], v_all[cached:] = k_new[start:start + n], v_new[start:start + n]
        for p in range(cached):
            k_cache[table[p // block_size], p % block_size] = k_all[p]
            v_cache[table[p // block_size], p % block_size] = v_all[p]
        slots += [table[p // block_size] * block_size + p % block_size for p in range(cached, length)]
        q_pos, k_pos = torch.arange(cached, length)[:, None], torch.arange(length)[None, :]
        mask = (k_pos <= q_pos) & ((q_pos - k_pos < window) if window else True)
        ref[start:start + n] = F.scaled_dot_product_attention(
            q[start:start + n].float().transpose(0, 1)[None], k_all.float().transpose(0, 1)[None],
            v_all.float().transpose(0, 1)[None], attn_mask=mask, enable_gqa=heads != kv_heads)[0].transpose(0, 1)
        tables.append(table)
        cu.append(start + n)
        lens.append(length)
    width = max(len(t) for t in tables)
    dev = torch.device(DEVICE)
    meta = PagedMetadata(torch.tensor(cu, dtype=torch.int32, device=dev),
                         torch.tensor(lens, dtype=torch.int32, device=dev),
                         torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32, device=dev),
                         max(n for _, n in spans))
    return (q.to(dev), k_new.to(dev), v_new.to(dev), k_cache.to(dev), v_cache.to(dev),
            torch.tensor(slots, device=dev), meta, ref)


@pytest.mark.parametrize("dtype,heads,kv_heads,dim,block_size,window,spans,tol", [
    # new prompts, decodes after a cached context, a chunk after a cached prefix; GQA groups of 2
    (torch.float32, 4, 2, 16, 16, None, [(0, 5), (20, 1), (33, 1), (16, 20)], 1e-5),
    # a group of 3 query heads per KV head (SmolLM2's 9/3), head_dim 64
    (torch.float32, 9, 3, 64, 16, None, [(0, 37), (40, 1), (5, 1)], 1e-5),
    # multi-head, blocks of 8, a sliding window of 12 crossed by prefill, chunk and decode
    (torch.float32, 4, 4, 32, 8, 12, [(0, 30), (40, 1), (10, 9)], 1e-5),
    (torch.bfloat16, 9, 3, 64, 16, None, [(0, 17), (40, 1)], 3e-2),
    (torch.float16, 8, 2, 128, 16, 7, [(0, 17), (40, 1)], 3e-3),
])
def test_paged_kernels_store_kv_in_place_and_attend_like_sdpa(triton_kernels, dtype, heads, kv_heads, dim,
                                                                block_size, window, spans, tol):
    q, k_new, v_new, k_cache, v_cache, slots, meta, ref = _paged_case(dtype, heads, kv_heads, dim, block_size,
                                                                       window, spans)
    triton_kernels.store_kv(k_new, v_new, k_cache, v_cache, slots)
    flat_k = k_cache.view(-1, kv_heads, dim)
    assert torch.equal(flat_k[slots.long()], k_new)                    # every new key in its own slot
    out = triton_kernels.paged_attention(q, k_cache, v_cache, meta, dim ** -0.5, window)
    assert (out.float().cpu() - ref).abs().max().item() <= tol


def test_a_slot_of_minus_one_is_not_stored(triton_kernels):
    cache = torch.zeros(4, 4, 1, 16, device=DEVICE)
    k = torch.ones(2, 1, 16, device=DEVICE)
    triton_kernels.store_kv(k, k, cache, cache.clone(), torch.tensor([3, -1], device=DEVICE))
    assert cache.view(-1, 16)[3].eq(1).all() and cache.sum().item() == 16


def _hf_engine(tmp_path, tiny_model_dir, variant, **kw):
    import shutil

    from test_model_parity import VARIANTS, WINDOWED, _save_hf

    VARIANTS_WITH_WINDOWS = VARIANTS | WINDOWED
    with pytest.MonkeyPatch.context() as mp:
        mp.setitem(VARIANTS, variant, VARIANTS_WITH_WINDOWS[variant])
        _save_hf(tmp_path, variant)
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(f"{tiny_model_dir}/{f}", tmp_path / f)
    return lambda **more: LLMEngine(EngineConfig(model=str(tmp_path), device=DEVICE, warmup=False, num_kv_blocks=64,
                                                 block_size=4, max_num_batched_tokens=24, dtype="float32", **kw | more))


@pytest.mark.parametrize("variant", ["llama3-gqa-rope-scaling", "qwen2-window"])
def test_paged_kernels_and_decode_graphs_serve_the_reference_tokens(triton_kernels, tmp_path, tiny_model_dir,
                                                                     variant):
    """Chunked prefills (blocks of 4, a 24-token budget), a prefix-cached prompt, batches of 1 to 3
    decodes (graph buckets 1, 2, 4 with padding), Qwen2's per-layer window of 8 crossed: the paged
    kernels, with and without decode graphs, give the reference path's tokens and logprobs, greedy and
    seeded-sampled alike."""
    pytest.importorskip("transformers")
    make = _hf_engine(tmp_path, tiny_model_dir, variant)
    g = torch.Generator().manual_seed(4)
    prompts = [torch.randint(5, 500, (n,), generator=g).tolist() for n in (3, 30, 13)]
    prompts.append(prompts[1][:20] + [7, 8])                   # five cached blocks, then two new tokens
    greedy = SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True, logprobs=0)
    sampled = SamplingParams(max_tokens=5, temperature=0.8, top_p=0.9, top_k=50, seed=11, ignore_eos=True,
                             logprobs=0, repetition_penalty=1.2)      # sampled on the device, seeded
    runs = {}
    for attention, graphs in (("torch", False), ("triton", False), ("triton", True)):
        eng = make(attention=attention, decode_graphs=graphs)
        assert eng.attention == attention and (eng.runner.graphs is not None) == graphs
        if graphs:     # captured on CUDA (as warm-up does); elsewhere the same padded forward runs eagerly
            assert eng.runner.capture_graphs() == (len(eng.runner.graphs.buckets) if DEVICE.startswith("cuda") else 0)
        seqs = [eng.add_request(p, greedy if i % 2 == 0 else sampled) for i, p in enumerate(prompts)]
        logprobs = {s.request_id: [] for s in seqs}
        while eng.has_unfinished:
            for ev in eng.step():
                logprobs[ev.request_id].append(ev.logprob)
        assert not eng.take_failures()
        runs[attention, graphs] = [(list(s.output_token_ids), logprobs[s.request_id]) for s in seqs]
        assert eng.stats().num_free_blocks == eng.stats().num_kv_blocks
    ref = runs["torch", False]
    for key in (("triton", False), ("triton", True)):
        assert [ids for ids, _ in runs[key]] == [ids for ids, _ in ref], key
        got, want = ([lp for _, lps in run for lp in lps] for run in (runs[key], ref))
        assert max(abs(a - b) for a, b in zip(got, want)) <= 1e-4


def test_decode_graph_buckets():
    from sits.engine.decode_graphs import bucket_sizes

    assert bucket_sizes(64) == [1, 2, 4, 8, 16, 32, 48, 64]
    assert bucket_sizes(20) == [1, 2, 4, 8, 16, 20] and bucket_sizes(3) == [1, 2, 3]


def test_logits_stay_on_the_device_and_only_ids_cross(tiny_model_dir):
    eng = _engine(tiny_model_dir, DEVICE)
    eng.add_request([5, 6, 7], SamplingParams(max_tokens=2, temperature=0.7, top_p=0.9, seed=1))
    batch = eng.scheduler.schedule()
    logits, rows = eng.runner.execute(batch)
    assert logits.device.type == torch.device(DEVICE).type and rows == [0]


def test_the_step_budget_and_kv_pool_follow_the_device(tiny_model_dir):
    from sits.engine.config import kv_blocks_for_device

    assert _engine(tiny_model_dir, DEVICE, max_num_batched_tokens=None).cfg.max_num_batched_tokens == (
        2048 if DEVICE.startswith("cuda") else 256)
    assert _engine(tiny_model_dir, DEVICE, max_num_batched_tokens=96).scheduler.cfg.max_num_batched_tokens == 96
    gib = 2**30
    # 80 GiB device, 60 free (20 held by weights and others), 90% of it ours, 2 GiB reserve: 70 - 20 - 2 = 48 GiB
    assert kv_blocks_for_device(60 * gib, 80 * gib, 0.9, 2 * gib, 2**20) == int(80 * gib * 0.9 - 22 * gib) // 2**20
    assert kv_blocks_for_device(5 * gib, 80 * gib, 0.5, gib, 2**20) == 0       # others hold more than our share
    if DEVICE.startswith("cuda"):
        eng = _engine(tiny_model_dir, DEVICE, num_kv_blocks=None, gpu_memory_utilization=0.3)
        free, total = torch.cuda.mem_get_info(DEVICE)
        assert eng.limits.num_kv_blocks > 128 and total - free <= 0.3 * total + 2**30


def test_lora_adapters_mixed_in_one_batch_on_the_device_give_the_cpu_tokens(tiny_model_dir, tmp_path):
    """Two adapters and the base model in the same steps (gathered low-rank matmuls, fused projections
    on a GPU): the CPU's greedy tokens."""
    from sits.modelbuild.lora import build_random_adapter

    adapters = tuple((f"a{k}", str(build_random_adapter(tiny_model_dir, tmp_path / f"a{k}", rank=8, seed=k, std=0.2)))
                     for k in range(2))
    prompts = [torch.randint(5, 500, (n,), generator=torch.Generator().manual_seed(n)).tolist() for n in (9, 30, 17)]
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)

    def run(device):
        eng = _engine(tiny_model_dir, device, lora_adapters=adapters, dtype="float32")
        seqs = [eng.add(eng.make_request(p, params, lora=lora)) for p, lora in zip(prompts, ["a0", None, "a1"])]
        while eng.has_unfinished:
            eng.step()
        return [list(s.output_token_ids) for s in seqs]

    got, want = run(DEVICE), run("cpu")
    assert got == want and len({tuple(t) for t in got}) == 3


def test_a_minimal_warm_up_leaves_the_decode_graphs_to_idle_moments(tiny_model_dir, triton_kernels):
    """A cold start's warm-up does not capture; idle_work then captures one bucket per call (on CUDA;
    without CUDA there is nothing to capture and idle_work has nothing to do)."""
    eng = _engine(tiny_model_dir, DEVICE, attention="triton", warmup=True, warmup_shapes="minimal", max_num_seqs=8)
    graphs = eng.runner.graphs
    assert graphs.graphs == {} and "graphs" not in eng.report.phases_ms
    calls = 0
    while eng.idle_work():
        calls += 1
    cuda = DEVICE.startswith("cuda")
    assert calls == (len(graphs.buckets) - 1 if cuda else 0) and len(graphs.graphs) == (len(graphs.buckets) if cuda else 0)
    out = eng.generate([[5, 6, 7]] * 3, SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))
    assert all(len(o["token_ids"]) == 4 for o in out)


def test_weights_go_to_the_device_through_two_reused_staging_buffers():
    """Chunks smaller than a tensor, tensors smaller than a chunk, an empty one, a dtype converted on
    the way: every tensor arrives whole; only the two staging buffers were ever allocated on the host."""
    from sits.engine.loader import StagedUpload

    g = torch.Generator().manual_seed(0)
    tensors = [torch.randn(n, generator=g).to(dtype) for n, dtype in
               ((0, torch.float32), (1, torch.float32), (999, torch.bfloat16), (10_000, torch.float32), (257, torch.float16))]
    up = StagedUpload(torch.device(DEVICE), chunk_bytes=1000)
    got = [up.upload(t, torch.float32) for t in tensors] + [up.upload(tensors[3].view(100, 100), torch.bfloat16)]
    up.finish()
    for t, out in zip(tensors, got):
        assert out.device.type == torch.device(DEVICE).type and torch.equal(out.cpu(), t.float())
    assert got[-1].shape == (100, 100) and torch.equal(got[-1].cpu(), tensors[3].view(100, 100).bfloat16())
    assert len(up.buffers) == 2 and all(b.numel() == 1000 for b in up.buffers)
    assert up.bytes == sum(t.numel() * 4 for t in tensors) + 10_000 * 2


def test_an_engine_from_a_host_copy_prepared_for_the_device_serves_the_checkpoints_tokens(tiny_model_dir):
    """A zygote keeps a GPU unit's weights in host memory as they will serve (the device's dtype,
    merged projections); an engine started from that copy (on a GPU: copied there, the phase
    ``weights_h2d``) gives the tokens of one that read the checkpoint, and the host copy is untouched."""
    from sits.engine.llm_engine import PreloadedModel

    cfg = EngineConfig(model=tiny_model_dir, device=DEVICE, dtype="bfloat16", warmup=False, kv_cache_memory_mb=16)
    pre = PreloadedModel.load(cfg)
    host = dict(pre.model.named_parameters())
    assert pre.fits(cfg, torch.device(DEVICE)) and all(p.device.type == "cpu" for p in host.values())
    prompts = [torch.randint(5, 500, (n,), generator=torch.Generator().manual_seed(n)).tolist() for n in (9, 33)]
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    ref = LLMEngine(cfg).generate(prompts, params)
    on_gpu = DEVICE.startswith("cuda")
    if on_gpu:                           # as a standby process does: the copies then need no staging
        from sits.engine.host_weights import pin_in_place, unpin_all
        assert pin_in_place([pre.host_region.tensor]) >= pre.host_region.nbytes
    try:
        eng = LLMEngine(cfg, preloaded=pre)
        assert eng.inherited_weights
        assert ("weights_h2d" if on_gpu else "weights") in eng.report.phases_ms
        assert [r["token_ids"] for r in eng.generate(prompts, params)] == [r["token_ids"] for r in ref]
        assert dict(pre.model.named_parameters()) == host
        assert all(p.device.type == torch.device(DEVICE).type for p in eng.model.parameters())
    finally:
        if on_gpu:
            unpin_all()


@pytest.mark.skipif(not DEVICE.startswith("cuda"), reason="page-locking host memory needs CUDA")
def test_host_memory_page_locked_in_place_reaches_the_device_without_staging():
    from sits.engine.host_weights import SharedHostRegion, is_pinned_in_place, pin_in_place, unpin_all
    from sits.engine.loader import StagedUpload

    unpin_all()
    region = SharedHostRegion(4 << 20)
    pinned = region.tensor[: 4 << 20].view(torch.float32)
    pinned.copy_(torch.randn(1 << 20))
    plain = torch.randn(1000)
    try:
        assert pin_in_place([pinned]) >= 4 << 20
        assert is_pinned_in_place(pinned) and is_pinned_in_place(pinned[10:20]) and not is_pinned_in_place(plain)
        assert pin_in_place([pinned[5:]]) == 0                  # registered once
        up = StagedUpload(torch.device(DEVICE), chunk_bytes=4096)
        got = [up.upload(pinned, torch.float32), up.upload(plain, torch.float32), up.upload(pinned, torch.bfloat16)]
        up.finish()
        assert torch.equal(got[0].cpu(), pinned) and torch.equal(got[1].cpu(), plain)
        assert torch.equal(got[2].cpu(), pinned.bfloat16())      # a conversion is staged
        assert up.direct_bytes == pinned.numel() * 4
        torch.ones(4, device=DEVICE).sum().item()              # no CUDA error left behind
    finally:
        unpin_all()
