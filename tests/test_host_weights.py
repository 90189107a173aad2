"""A GPU unit's weights kept in host memory by the zygote, prepared on the CPU for the device (no
CUDA context: the zygote forks), and copied whole to the device by each instance."""

from __future__ import annotations

import dataclasses

import torch

from sits.engine.config import EngineConfig
from sits.engine.llm_engine import PreloadedModel
from sits.engine.loader import upload_module


def test_weights_kept_for_a_gpu_are_prepared_on_the_host_and_copied_whole(tiny_model_dir):
    cfg = EngineConfig(model=tiny_model_dir, device="cuda", dtype="auto", warmup=False, kv_cache_memory_mb=8)
    pre = PreloadedModel.load(cfg)
    assert not torch.cuda.is_initialized()
    assert pre.device_type == "cuda" and pre.fits(cfg, torch.device("cuda"))
    assert not pre.fits(dataclasses.replace(cfg, device="cpu"), torch.device("cpu"))
    assert PreloadedModel.key(cfg) != PreloadedModel.key(dataclasses.replace(cfg, device="cpu"))
    layer = pre.model.model.layers[0]
    assert layer.self_attn.qkv_proj is not None and layer.mlp.gate_up_proj is not None      # merged, as on a GPU
    assert all(p.dtype == torch.bfloat16 for p in pre.model.parameters())                   # auto on a GPU
    # all of it in one shared mapping (a fork shares its pages; pinning them copies none)
    region = pre.host_region
    assert all(region.contains(t) for t in (*pre.model.parameters(), *pre.model.buffers()))
    assert pre.model.lm_head.weight is pre.model.model.embed_tokens.weight
    with open("/proc/self/maps") as f:
        maps = [line.split() for line in f if "memfd:sits-weights" in line]
    assert maps and all(fields[1][3] == "s" for fields in maps)                           # rw-s: shared

    # the copy (here to the CPU: the same chunked path through plain buffers), in another dtype
    before = {n: (p, p.clone()) for n, p in pre.model.named_parameters()}
    copy = upload_module(pre.model, torch.device("cpu"), torch.float32)
    assert copy is not pre.model
    assert all(p.dtype == torch.float32 for p in copy.parameters())
    assert copy.model.rotary.cos.dtype == torch.float32
    assert copy.lm_head.weight is copy.model.embed_tokens.weight           # tied weights stay tied
    for name, p in copy.named_parameters():
        orig, value = before[name]
        assert p.data_ptr() != orig.data_ptr() and torch.equal(p, value.float())
    assert all(p is before[n][0] and torch.equal(p, before[n][1]) for n, p in pre.model.named_parameters())
    # the copy computes what the host copy computes (same dtype: the same logits, bit for bit)
    same = upload_module(pre.model, torch.device("cpu"), torch.bfloat16)
    ids = torch.randint(5, 500, (1, 12), generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        assert torch.equal(same.forward_dense(ids), pre.model.forward_dense(ids))
