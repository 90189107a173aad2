"""The Hugging Face model a benchmark compares the engine with, on the same weights: a Hugging Face
folder through ``from_pretrained``, a GGUF file through the weights SITS dequantizes from it (not
transformers' own GGUF conversion, which needs more packages and reads the tokenizer wrongly for
SmolLM2; a benchmark feeds token ids, so only the weights matter)."""

from __future__ import annotations

import time

import torch

from sits.engine.config import ModelConfig


def vocab_size(model: str) -> int:
    return ModelConfig.from_dir(model).vocab_size


def load_hf_causal_lm(model: str, dtype: torch.dtype, device: torch.device):
    """transformers' model class for ``model``'s architecture with its weights, in ``dtype``."""
    import transformers   # benchmark-only dependency

    from sits.engine.gguf_model import open_gguf

    gguf = open_gguf(model)
    if gguf is None:
        cfg = ModelConfig.from_dir(model)
        cls = getattr(transformers, cfg.architecture)
        return cls.from_pretrained(model, torch_dtype=dtype).to(device).eval()
    cfg = gguf.model_config()
    family = cfg.architecture.removesuffix("ForCausalLM")
    hf_cfg = getattr(transformers, f"{family}Config")(
        vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size, intermediate_size=cfg.intermediate_size,
        num_hidden_layers=cfg.num_hidden_layers, num_attention_heads=cfg.num_attention_heads,
        num_key_value_heads=cfg.num_key_value_heads, head_dim=cfg.head_dim,
        max_position_embeddings=cfg.max_position_embeddings, rms_norm_eps=cfg.rms_norm_eps,
        rope_theta=cfg.rope_theta, rope_scaling=cfg.rope_scaling, tie_word_embeddings=cfg.tie_word_embeddings,
        bos_token_id=cfg.bos_token_id, eos_token_id=cfg.eos_token_id or None)
    hf = getattr(transformers, cfg.architecture)(hf_cfg).to(dtype)
    missing, unexpected = hf.load_state_dict(gguf.state_dict(dtype), strict=False)
    if unexpected or set(missing) - {"lm_head.weight"}:
        raise RuntimeError(f"{model}: GGUF weights do not fit {cfg.architecture}: missing {missing}, "
                           f"unexpected {unexpected}")
    if cfg.tie_word_embeddings:
        hf.tie_weights()
    return hf.to(device).eval()


def hf_decode_tok_s(hf, prompts: list[list[int]], out_len: int, batched: bool, pad_id: int, hw) -> float:
    """Greedy ``generate`` of ``out_len`` tokens per prompt: new tokens per second. ``batched``: all
    prompts in one left-padded call; else one call per prompt. ``hw``: the benchmark's ``Hardware``."""
    kw = dict(max_new_tokens=out_len, min_new_tokens=out_len, do_sample=False, pad_token_id=pad_id)
    dev = hw.device
    hw.sync()
    t0 = time.perf_counter()
    n = 0
    with torch.inference_mode():
        if batched:
            width = max(len(p) for p in prompts)
            ids = torch.tensor([[pad_id] * (width - len(p)) + p for p in prompts], device=dev)
            mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], device=dev)
            out = hf.generate(input_ids=ids, attention_mask=mask, **kw)
            n = (out.shape[1] - width) * len(prompts)
        else:
            for p in prompts:
                out = hf.generate(input_ids=torch.tensor([p], device=dev),
                                  attention_mask=torch.ones(1, len(p), dtype=torch.long, device=dev), **kw)
                n += out.shape[1] - len(p)
    hw.sync()
    return n / (time.perf_counter() - t0)
