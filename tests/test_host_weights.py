"""A GPU unit's weights kept in host memory by the zygote, prepared on the CPU for the device (no
CUDA context: the zygote forks), and copied whole to the device by each instance."""

from __future__ import annotations

import asyncio
import dataclasses
import fcntl
import os
import signal
import socket
from dataclasses import asdict

import torch

from sits.engine.config import EngineConfig
from sits.engine.llm_engine import PreloadedModel
from sits.engine.loader import upload_module
from test_gateway import wait_for


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


def test_a_host_copy_sent_to_another_process_maps_the_same_pages(tiny_model_dir):
    """What a zygote's loader process sends (the region's descriptor, the rest pickled around it) is
    rebuilt over the same pages, tied weights still tied, no weight copied."""
    cfg = EngineConfig(model=tiny_model_dir, device="cuda", dtype="auto", warmup=False, kv_cache_memory_mb=8)
    pre = PreloadedModel.load(cfg)
    fd, nbytes, data = pre.export()
    assert len(data) < nbytes             # the weights stay in the region: what is pickled is the rest
    ours, theirs = socket.socketpair()
    with ours, theirs:
        socket.send_fds(ours, [b"w"], [fd])
        _, fds, _, _ = socket.recv_fds(theirs, 1, 1)
    got = PreloadedModel.attach(fds[0], nbytes, data)
    assert got.fits(cfg, torch.device("cuda")) and got.device_type == "cuda"
    assert got.model.lm_head.weight is got.model.model.embed_tokens.weight
    tensors = (*got.model.parameters(), *got.model.buffers())
    assert all(got.host_region.contains(t) for t in tensors)
    assert all(isinstance(p, torch.nn.Parameter) and not p.requires_grad for p in got.model.parameters())
    # the same pages through two mappings: a write through one is read through the other
    mine, theirs_ = pre.model.model.norm.weight, got.model.model.norm.weight
    assert mine.data_ptr() != theirs_.data_ptr()
    with torch.no_grad():
        mine[0] = 7.0
    assert theirs_[0].item() == 7.0
    ids = torch.randint(5, 500, (1, 12), generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        assert torch.equal(got.model.forward_dense(ids), pre.model.forward_dense(ids))
    text = "Hello, world: 12345"
    assert got.tokenizer.encode(text) == pre.tokenizer.encode(text)
    chat = [{"role": "user", "content": "hi"}]
    assert got.tokenizer.apply_chat_template(chat) == pre.tokenizer.apply_chat_template(chat)


def test_a_gpu_units_weights_load_apart_while_the_zygote_forks(tiny_model_dir, tmp_path):
    """A GPU unit's host copy is built by a loader process: the zygote forks instances meanwhile, the
    GPU unit's own among them (it reads the checkpoint itself rather than wait), and maps the copy
    when it comes. A loader that dies is a failed preload; an undeploy stops the load. The loader is
    held on a lock its test seam names."""
    from sits.runtime.zygote import LOADER_GATE, ZygoteClient
    from test_standby import zygote_children

    gate = tmp_path / "gate"
    gate.touch()
    gpu = asdict(EngineConfig(model=tiny_model_dir, device="cuda", warmup=False, kv_cache_memory_mb=8))
    cpu = asdict(EngineConfig(model=tiny_model_dir, device="cpu", warmup=False, kv_cache_memory_mb=8))

    async def stop(*children) -> None:
        for c in children:
            c.kill()
            await asyncio.wait_for(c.wait_async(), 60)

    def mapped(pid: int) -> bool:
        with open(f"/proc/{pid}/maps") as f:
            return "memfd:sits-weights" in f.read()

    async def main() -> None:
        with open(gate) as held:
            fcntl.flock(held, fcntl.LOCK_EX)
            zygote = await ZygoteClient.start(env={**os.environ, LOADER_GATE: str(gate)})
            zpid = zygote.info["pid"]
            try:
                zygote.preload(gpu)
                loader = wait_for(lambda: zygote_children(zpid), what="the loader forked")
                cpu_child = await asyncio.wait_for(zygote.fork(str(tmp_path / "c.sock"), cpu), 120)
                gpu_child = await asyncio.wait_for(zygote.fork(str(tmp_path / "g1.sock"), gpu), 120)
                assert zygote.preload_state(gpu) is None and not mapped(zpid)     # the load is still held
                assert zygote_children(zpid) == loader | {cpu_child.pid, gpu_child.pid}
                await stop(cpu_child, gpu_child)
                fcntl.flock(held, fcntl.LOCK_UN)               # the checkpoint can be read now
                assert (await zygote.wait_preloaded(gpu, 120))["ok"] is True
                assert mapped(zpid)                              # the loader's pages, mapped by the zygote
                after = await asyncio.wait_for(zygote.fork(str(tmp_path / "g2.sock"), gpu), 120)
                assert mapped(after.pid)                         # inherited by the starts after it
                await stop(after)

                # a loader that dies: the preload failed (starts read the checkpoint themselves)
                zygote.forget(gpu)
                wait_for(lambda: not zygote_children(zpid), what="the first loader reaped")
                fcntl.flock(held, fcntl.LOCK_EX)
                zygote.preload(gpu)
                loader = wait_for(lambda: zygote_children(zpid), what="the loader forked")
                os.kill(next(iter(loader)), signal.SIGKILL)
                assert (await zygote.wait_preloaded(gpu, 120))["ok"] is False
                wait_for(lambda: not zygote_children(zpid), what="the loader reaped")

                # undeployed while its copy is being built: the loader is stopped
                zygote.preload(gpu)                              # tried again
                wait_for(lambda: zygote_children(zpid), what="the loader forked")
                zygote.forget(gpu)
                wait_for(lambda: not zygote_children(zpid), what="the loader stopped")
                assert zygote.preload_state(gpu) is None
            finally:
                await zygote.shutdown()

    asyncio.run(main())
