"""A random LoRA adapter for a model folder, written in PEFT's format (``adapter_config.json`` +
``adapter_model.safetensors``): what benchmarks and tests serve when no trained adapter is at hand.
B is random too (PEFT initialises it to zeros, which would change nothing)."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file

from sits.engine.config import ModelConfig

ALL_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def build_random_adapter(model_dir: str | Path, out: str | Path, *, rank: int = 16, alpha: float = 32,
                         targets: tuple[str, ...] = ALL_TARGETS, seed: int = 0, std: float = 0.02) -> Path:
    mc = ModelConfig.from_dir(model_dir)
    q, kv = mc.num_attention_heads * mc.head_dim, mc.num_key_value_heads * mc.head_dim
    h, inter = mc.hidden_size, mc.intermediate_size
    shapes = {"q_proj": (h, q), "k_proj": (h, kv), "v_proj": (h, kv), "o_proj": (q, h),
              "gate_proj": (h, inter), "up_proj": (h, inter), "down_proj": (inter, h)}
    g = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(mc.num_hidden_layers):
        for module in targets:
            block = "self_attn" if module in ("q_proj", "k_proj", "v_proj", "o_proj") else "mlp"
            n_in, n_out = shapes[module]
            key = f"base_model.model.model.layers.{layer}.{block}.{module}"
            tensors[f"{key}.lora_A.weight"] = torch.randn(rank, n_in, generator=g) * std
            tensors[f"{key}.lora_B.weight"] = torch.randn(n_out, rank, generator=g) * std
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out / "adapter_model.safetensors"))
    (out / "adapter_config.json").write_text(json.dumps({
        "peft_type": "LORA", "r": rank, "lora_alpha": alpha, "target_modules": list(targets), "lora_dropout": 0.0,
        "bias": "none", "use_rslora": False, "use_dora": False, "base_model_name_or_path": str(model_dir)}, indent=2))
    return out


__all__ = ["build_random_adapter", "ALL_TARGETS"]
