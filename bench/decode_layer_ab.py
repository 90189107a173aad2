"""One decoder layer's pieces on a CPU, the code before the decode-only attention path (written out
here as it was) against the engine's, in one process taking turns, medians of 400 calls each; the old
and new outputs are checked to be the same bits first. Then q/k/v and gate/up as separate linears vs
merged ones, per layer (random weights of the model's shapes, split as the engine splits them).

    .venv/bin/python bench/decode_layer_ab.py MODEL_DIR STREAMS
"""

import statistics
import sys
import time

import torch

from sits.engine.config import EngineConfig, ModelConfig
from sits.engine.layers.attention import decode_attention
from sits.engine.layers.linear import Linear, fuse_linears, split_linears
from sits.engine.llm_engine import LLMEngine
from sits.engine.sampling_params import SamplingParams


def _medians(fns: dict, calls: int) -> dict:
    times = {name: [] for name in fns}
    for _ in range(calls):
        for name, fn in fns.items():
            start = time.perf_counter()
            fn()
            times[name].append((time.perf_counter() - start) * 1e6)
    return {name: round(statistics.median(t), 1) for name, t in times.items()}


def attention_and_norm(model_dir: str, streams: int) -> None:
    eng = LLMEngine(EngineConfig(model=model_dir, device="cpu", dtype="float32", warmup=False, kv_cache_memory_mb=256))
    runner, model = eng.runner, eng.model
    for s in range(streams):
        eng.add_request([(s * 31 + i * 7) % 1000 + 5 for i in range(16)],
                        SamplingParams(max_tokens=200, temperature=0.0, ignore_eos=True))
    def ready():    # every sequence past its first decode, its next token's block already held
        running = eng.scheduler.running
        return running and all(s.num_computed_tokens > 16 and s.num_computed_tokens % runner.block_size
                               for s in running)
    while not ready():
        eng.step()
    seqs = list(eng.scheduler.running)
    _, positions, meta, _ = runner.prepare(seqs, [1] * len(seqs))
    layer = model.model.layers[0]
    attn, norm, kv = layer.self_attn, layer.input_layernorm, runner.kv.layers[0]
    x = torch.randn(len(seqs), model.config.hidden_size)
    cos, sin = model.model.rotary(positions, x.dtype)

    def old_attention():
        q, k, v = attn._qkv(x, cos, sin)
        k_cache, v_cache = kv[0], kv[1]
        k_cache.view(-1, attn.num_kv_heads, attn.head_dim).index_copy_(0, meta.slot_mapping, k)
        v_cache.view(-1, attn.num_kv_heads, attn.head_dim).index_copy_(0, meta.slot_mapping, v)
        out = torch.empty_like(q)
        bt = meta.decode_block_tables
        kd = k_cache[bt].view(bt.shape[0], -1, attn.num_kv_heads, attn.head_dim).transpose(1, 2)
        vd = v_cache[bt].view(bt.shape[0], -1, attn.num_kv_heads, attn.head_dim).transpose(1, 2)
        out[meta.decode_index] = decode_attention(q[meta.decode_index].unsqueeze(2), kd, vd, meta.decode_mask).squeeze(2)
        return attn.o_proj(out.reshape(out.shape[0], -1))

    def old_norm():
        y = x.float()
        y = y * torch.rsqrt(y.pow(2).mean(-1, keepdim=True) + norm.eps)
        return norm.weight * y.to(x.dtype)

    with torch.inference_mode():
        assert torch.equal(old_attention(), attn(x, cos, sin, kv, meta)), "attention differs"
        assert torch.equal(old_norm(), norm(x)), "norm differs"
        print(f"{streams} streams, us per call:", _medians({
            "attention, old": old_attention, "attention, new": lambda: attn(x, cos, sin, kv, meta),
            "norm, old": old_norm, "norm, new": lambda: norm(x)}, 400))


def merged_projections(hidden: int, inter: int, kv: int, rows: int, layers: int = 8) -> None:
    def linear(out_features, in_features):
        layer = Linear(in_features, out_features)
        layer.weight = torch.nn.Parameter(torch.randn(out_features, in_features), requires_grad=False)
        return layer

    parts = [[linear(hidden, hidden), linear(kv, hidden), linear(kv, hidden)] for _ in range(layers)]
    parts += [[linear(inter, hidden), linear(inter, hidden)] for _ in range(layers)]
    merged = [fuse_linears(p) for p in parts]
    for m in [m for p in parts for m in p] + merged:
        split_linears(m)
    x = torch.randn(rows, hidden)
    with torch.inference_mode():
        med = _medians({"separate": lambda: [[m(x) for m in p] for p in parts],
                        "merged": lambda: [m(x) for m in merged]}, 150)
    print(f"q/k/v + gate/up at {rows} rows, us per layer:", {k: round(v / layers, 1) for k, v in med.items()})


if __name__ == "__main__":
    attention_and_norm(sys.argv[1], int(sys.argv[2]))

    mc = ModelConfig.from_dir(sys.argv[1])
    for rows in (1, 8, 32):
        merged_projections(mc.hidden_size, mc.intermediate_size, mc.num_key_value_heads * mc.head_dim, rows)
