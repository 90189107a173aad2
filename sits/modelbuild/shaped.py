"""Random-weight checkpoints with the shapes of real models (Llama-3.2-1B, Llama-3.1-8B), for the
device benchmarks: what a step or a cold start costs depends on the shapes and bytes, not on what the
weights say, and the real checkpoints cannot be downloaded at run time.

The weights are drawn in the target dtype on the chosen device (seconds for 16 GB on a GPU; drawing
them in fp32 on a CPU first would take minutes and twice the memory) and written as one
``model.safetensors``. The tokenizer is the tiny models' byte-level BPE (a few thousand tokens): the
model's vocabulary keeps the real size, so the embedding and LM head cost what they really cost, and
ids past the tokenizer's decode to nothing.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from sits.modelbuild.tiny import (BOS_ID, EOS_ID, IM_END_ID, PAD_ID, _corpus, _tokenizer_config, _train_tokenizer,
                                  _write_json)

LLAMA3_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 8192}

SHAPES: dict[str, dict[str, Any]] = {
    "llama-3.2-1b": {"vocab_size": 128256, "hidden_size": 2048, "intermediate_size": 8192, "num_hidden_layers": 16,
                     "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 64,
                     "tie_word_embeddings": True},
    "llama-3.1-8b": {"vocab_size": 128256, "hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32,
                     "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128,
                     "tie_word_embeddings": False},
}


def shaped_config(shape: str, max_positions: int = 8192) -> dict[str, Any]:
    p = SHAPES[shape]
    return {"architectures": ["LlamaForCausalLM"], "model_type": "llama", **p,
            "max_position_embeddings": max_positions, "rms_norm_eps": 1e-5, "rope_theta": 500000.0,
            "rope_scaling": LLAMA3_ROPE, "hidden_act": "silu", "attention_bias": False, "attention_dropout": 0.0,
            "mlp_bias": False, "bos_token_id": BOS_ID, "eos_token_id": [EOS_ID, IM_END_ID], "pad_token_id": PAD_ID,
            "torch_dtype": "bfloat16", "use_cache": True}


def parameter_shapes(cfg: dict[str, Any]) -> dict[str, tuple[int, ...]]:
    """Every tensor of a Llama checkpoint under Hugging Face's names (a tied LM head is not stored)."""
    h, i, v = cfg["hidden_size"], cfg["intermediate_size"], cfg["vocab_size"]
    q, kv = cfg["num_attention_heads"] * cfg["head_dim"], cfg["num_key_value_heads"] * cfg["head_dim"]
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (v, h), "model.norm.weight": (h,)}
    for n in range(cfg["num_hidden_layers"]):
        pre = f"model.layers.{n}."
        shapes |= {pre + "self_attn.q_proj.weight": (q, h), pre + "self_attn.k_proj.weight": (kv, h),
                   pre + "self_attn.v_proj.weight": (kv, h), pre + "self_attn.o_proj.weight": (h, q),
                   pre + "mlp.gate_proj.weight": (i, h), pre + "mlp.up_proj.weight": (i, h),
                   pre + "mlp.down_proj.weight": (h, i), pre + "input_layernorm.weight": (h,),
                   pre + "post_attention_layernorm.weight": (h,)}
    if not cfg["tie_word_embeddings"]:
        shapes["lm_head.weight"] = (v, h)
    return shapes


def build_shaped_model(out_dir: str | Path, shape: str = "llama-3.2-1b", *, seed: int = 0, device: str = "cpu",
                       dtype: torch.dtype = torch.bfloat16, max_positions: int = 8192,
                       progress: Callable[[str], None] | None = print) -> Path:
    """Write a model directory with ``shape``'s config and random weights (normal, std 0.02; norms 1)."""
    if shape not in SHAPES:
        raise ValueError(f"unknown shape {shape!r}; choose one of {', '.join(SHAPES)}")
    say = progress or (lambda _msg: None)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    cfg = shaped_config(shape, max_positions)
    gen = torch.Generator(device=device).manual_seed(seed)
    state = {}
    for name, dims in parameter_shapes(cfg).items():
        if name.endswith("norm.weight"):
            state[name] = torch.ones(dims, dtype=dtype)
        else:
            state[name] = (torch.randn(dims, generator=gen, device=device, dtype=torch.float32) * 0.02).to(dtype).cpu()
    num_params = sum(t.numel() for t in state.values())
    gigabytes = num_params * state['model.norm.weight'].element_size() / 1e9
    say(f"weights: {shape}, {num_params:,} parameters ({gigabytes:.2f} "
        f"GB) drawn in {time.perf_counter() - t0:.1f}s")
    t1 = time.perf_counter()
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
    del state
    _train_tokenizer(_corpus(), 4096).save(str(out / "tokenizer.json"))
    _write_json(out / "tokenizer_config.json", _tokenizer_config())
    _write_json(out / "build_info.json", {"shape": shape, "seed": seed, "num_parameters": num_params,
                                          "random_weights": True})
    _write_json(out / "config.json", cfg)
    say(f"saved {out} in {time.perf_counter() - t1:.1f}s")
    return out
