"""Native Llama-family model vs the transformers implementation, same weights: logits within 1e-4."""

from __future__ import annotations

import pytest
import torch

from sits.engine.config import EngineConfig, ModelConfig
from sits.engine.errors import ModelLoadError, UnsupportedModelError
from sits.engine.llm_engine import LLMEngine
from sits.engine.loader import load_model
from sits.engine.sampling_params import SamplingParams

from conftest import require_cpu_kernel

transformers = pytest.importorskip("transformers")

BASE = dict(vocab_size=512, hidden_size=64, intermediate_size=160, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=256, rms_norm_eps=1e-5)

VARIANTS = {
    "llama2-mha-untied": ("LlamaConfig", "LlamaForCausalLM", dict(num_key_value_heads=4, tie_word_embeddings=False)),
    "llama3-gqa-rope-scaling": ("LlamaConfig", "LlamaForCausalLM", dict(
        rope_theta=500000.0, tie_word_embeddings=True,
        rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                      "original_max_position_embeddings": 64})),
    "llama-linear-rope": ("LlamaConfig", "LlamaForCausalLM", dict(rope_scaling={"rope_type": "linear", "factor": 2.0})),
    "mistral": ("MistralConfig", "MistralForCausalLM", dict(sliding_window=None, head_dim=16)),
    "qwen2-qkv-bias": ("Qwen2Config", "Qwen2ForCausalLM", dict(tie_word_embeddings=True)),
}


def _save_hf(tmp_path, variant: str):
    cfg_cls, model_cls, extra = VARIANTS[variant]
    cfg = getattr(transformers, cfg_cls)(**(BASE | extra))
    torch.manual_seed(0)
    model = getattr(transformers, model_cls)(cfg).eval()
    with torch.no_grad():   # make biases non-zero so Qwen2's qkv bias is really exercised
        for name, p in model.named_parameters():
            if name.endswith("bias"):
                p.normal_(0, 0.5)
    model.save_pretrained(tmp_path, safe_serialization=True)
    return model


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_dense_logits_match_transformers(tmp_path, variant):
    hf = _save_hf(tmp_path, variant)
    cfg = ModelConfig.from_dir(tmp_path)
    ours = load_model(tmp_path, cfg, torch.device("cpu"), torch.float32, cfg.max_position_embeddings)
    ids = torch.randint(0, BASE["vocab_size"], (2, 100), generator=torch.Generator().manual_seed(1))
    with torch.inference_mode():
        ref = hf(input_ids=ids).logits.float()
        got = ours.forward_dense(ids)
    assert (ref - got).abs().max().item() <= 1e-4


@pytest.mark.parametrize("attention", ["torch", "cpp"])   # decodes gathered, or read in place by the C++ kernel
@pytest.mark.parametrize("variant", ["llama3-gqa-rope-scaling", "qwen2-qkv-bias"])
def test_paged_engine_logits_match_transformers(tmp_path, variant, tiny_model_dir, attention):
    """The serving path (chunked prefill through block tables, then decodes) equals HF logits."""
    if attention == "cpp":
        require_cpu_kernel()
    import shutil
    hf = _save_hf(tmp_path, variant)
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(f"{tiny_model_dir}/{f}", tmp_path / f)
    eng = LLMEngine(EngineConfig(model=str(tmp_path), device="cpu", warmup=False, num_kv_blocks=64,
                                 block_size=4, max_num_batched_tokens=16, attention=attention))
    prompt = torch.randint(5, BASE["vocab_size"], (37,), generator=torch.Generator().manual_seed(2)).tolist()
    out = eng.generate([prompt], SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, logprobs=0))[0]
    ids = prompt + out["token_ids"]
    with torch.inference_mode():
        ref = hf(input_ids=torch.tensor([ids])).logits[0].float()
    ref_tokens = ref[len(prompt) - 1:-1].argmax(-1).tolist()
    assert out["token_ids"] == ref_tokens


def test_unsupported_architecture_is_a_clear_error(tmp_path):
    (tmp_path / "config.json").write_text('{"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2"}')
    with pytest.raises(UnsupportedModelError) as e:
        ModelConfig.from_dir(tmp_path)
    assert e.value.code == "unsupported_model" and "GPT2LMHeadModel" in e.value.message


def test_missing_weights_is_a_clear_error(tmp_path, tiny_model_dir):
    import shutil
    shutil.copy(f"{tiny_model_dir}/config.json", tmp_path / "config.json")
    with pytest.raises(ModelLoadError) as e:
        load_model(tmp_path, ModelConfig.from_dir(tmp_path), torch.device("cpu"), torch.float32, 128)
    assert "safetensors" in e.value.message


def test_weights_are_zero_copy_views_of_the_mapped_file(tiny_model_dir):
    cfg = ModelConfig.from_dir(tiny_model_dir)
    model = load_model(tiny_model_dir, cfg, torch.device("cpu"), torch.float32, 128)
    from sits.engine.loader import SafetensorsFile
    import pathlib
    f = SafetensorsFile(pathlib.Path(tiny_model_dir) / "model.safetensors")
    # Both views start inside the same mmap'd buffer; no weight was copied into fresh memory.
    w = model.model.layers[0].mlp.up_proj.weight
    assert not w.untyped_storage().resizable()          # frombuffer storage over the mapping
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    assert set(f.header) >= {"model.embed_tokens.weight"}


@pytest.mark.parametrize("variant, extra", [
    ("llama-attention-and-mlp-bias", ("LlamaConfig", "LlamaForCausalLM", dict(attention_bias=True, mlp_bias=True))),
    ("qwen2-yarn", ("Qwen2Config", "Qwen2ForCausalLM", dict(rope_scaling={
        "rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64, "beta_fast": 32, "beta_slow": 1}))),
])
def test_biases_and_yarn_match_transformers(tmp_path, variant, extra):
    """Llama's attention_bias puts a bias on o_proj too and mlp_bias on the MLP; Qwen2.5's yarn rope."""
    VARIANTS[variant] = extra
    try:
        hf = _save_hf(tmp_path, variant)
    finally:
        del VARIANTS[variant]
    cfg = ModelConfig.from_dir(tmp_path)
    ours = load_model(tmp_path, cfg, torch.device("cpu"), torch.float32, cfg.max_position_embeddings)
    ids = torch.randint(0, BASE["vocab_size"], (2, 200), generator=torch.Generator().manual_seed(2))
    with torch.inference_mode():
        ref = hf(input_ids=ids).logits.float()
        got = ours.forward_dense(ids)
    assert (ref - got).abs().max().item() <= 1e-4


WINDOWED = {
    "mistral-window": ("MistralConfig", "MistralForCausalLM", dict(sliding_window=8, head_dim=16)),
    # Qwen2 slides from layer max_window_layers on: layer 0 full, layer 1 windowed
    "qwen2-window": ("Qwen2Config", "Qwen2ForCausalLM", dict(use_sliding_window=True, sliding_window=8,
                                                             max_window_layers=1)),
}


@pytest.mark.parametrize("attention", ["torch", "cpp"])   # decodes gathered, or read in place by the C++ kernel
@pytest.mark.parametrize("variant", sorted(WINDOWED))
def test_sliding_window_attention_matches_transformers(tmp_path, variant, tiny_model_dir, attention):
    """Sliding-window attention (Mistral; Qwen2's per-layer windows) past the window: the dense path's
    logits, and the serving path's greedy tokens and logprobs through chunked prefill (chunks of 16
    over a window of 8 with blocks of 4), decodes, and a prefix-cached second request."""
    if attention == "cpp":
        require_cpu_kernel()
    import shutil
    VARIANTS[variant] = WINDOWED[variant]
    try:
        hf = _save_hf(tmp_path, variant)
    finally:
        del VARIANTS[variant]
    cfg = ModelConfig.from_dir(tmp_path)
    assert cfg.sliding_window == 8
    ids = torch.randint(0, BASE["vocab_size"], (2, 60), generator=torch.Generator().manual_seed(1))
    ours = load_model(tmp_path, cfg, torch.device("cpu"), torch.float32, cfg.max_position_embeddings)
    with torch.inference_mode():
        assert (hf(input_ids=ids).logits.float() - ours.forward_dense(ids)).abs().max().item() <= 1e-4

    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(f"{tiny_model_dir}/{f}", tmp_path / f)
    eng = LLMEngine(EngineConfig(model=str(tmp_path), device="cpu", warmup=False, num_kv_blocks=64,
                                 block_size=4, max_num_batched_tokens=16, attention=attention))
    assert eng.max_model_len == BASE["max_position_embeddings"]     # not capped at the window
    prompt = torch.randint(5, BASE["vocab_size"], (37,), generator=torch.Generator().manual_seed(2)).tolist()
    params = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True, logprobs=0)
    for p in (prompt, prompt[:30] + [7, 8, 9]):                     # the second reuses cached blocks
        seq = eng.add_request(p, params)
        logprobs = []
        while eng.has_unfinished:
            logprobs += [ev.logprob for ev in eng.step()]
        tokens = list(seq.output_token_ids)
        with torch.inference_mode():
            ref = torch.log_softmax(hf(input_ids=torch.tensor([p + tokens])).logits[0].float(), -1)
        steps = ref[len(p) - 1:-1]
        assert tokens == steps.argmax(-1).tolist()
        want = steps.gather(1, torch.tensor(tokens)[:, None])[:, 0]
        assert (torch.tensor(logprobs) - want).abs().max().item() <= 1e-4
    assert seq.num_cached_tokens >= 28


def test_qwen2_window_counts_only_with_use_sliding_window():
    qwen = ModelConfig.from_dict({"architectures": ["Qwen2ForCausalLM"], "vocab_size": 64, "hidden_size": 32,
                                  "intermediate_size": 64, "num_hidden_layers": 1, "num_attention_heads": 4,
                                  "sliding_window": 32, "use_sliding_window": False, "max_position_embeddings": 128})
    assert qwen.sliding_window is None and qwen.layer_window(0) is None
    assert qwen.attention_bias and not qwen.o_proj_bias
