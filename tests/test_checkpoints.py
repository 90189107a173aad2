"""Real checkpoints load as their authors meant: the compute dtype follows the checkpoint (and its
weights are mapped, not copied, when that is the stored dtype), sharded checkpoints follow their
index, and a quantized checkpoint is refused by name."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from sits.engine.config import EngineConfig, ModelConfig, cpu_computes_bf16, resolve_dtype
from sits.engine.errors import ModelLoadError, UnsupportedModelError
from sits.engine.llm_engine import LLMEngine
from sits.engine.loader import SafetensorsFile, weight_files
from sits.engine.sampling_params import SamplingParams

transformers = pytest.importorskip("transformers")

CPU, CUDA = torch.device("cpu"), torch.device("cuda")
GREEDY = dict(temperature=0.0, ignore_eos=True)


def _checkpoint(path, dtype: torch.dtype, shard: str | None = None, tokenizer_from: str | None = None):
    cfg = transformers.LlamaConfig(vocab_size=4096, hidden_size=64, intermediate_size=160, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(cfg).to(dtype).eval()
    model.save_pretrained(path, max_shard_size=shard or "5GB")
    if tokenizer_from is not None:
        for name in ("tokenizer.json", "tokenizer_config.json"):
            shutil.copy(f"{tokenizer_from}/{name}", path / name)
    return model


def test_auto_dtype_follows_the_checkpoint():
    native = torch.bfloat16 if cpu_computes_bf16() else torch.float32
    assert resolve_dtype("auto", CPU, "bfloat16") == native
    assert resolve_dtype("auto", CPU, "float16") == native
    assert resolve_dtype("auto", CPU, "float32") == torch.float32
    assert resolve_dtype("float32", CPU, "bfloat16") == torch.float32          # an explicit dtype wins
    assert resolve_dtype("auto", CUDA, "float16") == torch.float16
    with pytest.raises(UnsupportedModelError):
        resolve_dtype("int3", CPU, "float32")


def test_a_bf16_checkpoint_is_served_in_bf16_from_the_mapped_file(tmp_path, tiny_model_dir):
    if not cpu_computes_bf16():
        pytest.skip("this CPU has no native bf16: auto is fp32 here")
    _checkpoint(tmp_path, torch.bfloat16, tokenizer_from=tiny_model_dir)
    engine = LLMEngine(EngineConfig(model=str(tmp_path), device="cpu", warmup=False, kv_cache_memory_mb=8,
                                    pack_weights=False))
    assert engine.dtype == torch.bfloat16 and engine.kv_cache.layers[0].dtype == torch.bfloat16
    # views into the file's mapping, not copies: two weights lie as far apart as in the file
    header = SafetensorsFile(tmp_path / "model.safetensors").header
    a, b = "model.layers.0.mlp.up_proj.weight", "model.layers.1.mlp.down_proj.weight"
    layers = engine.model.model.layers
    assert (layers[1].mlp.down_proj.weight.data_ptr() - layers[0].mlp.up_proj.weight.data_ptr()
            == header[b]["data_offsets"][0] - header[a]["data_offsets"][0])
    out = engine.generate([[1, 2, 3]], [SamplingParams(max_tokens=4, **GREEDY)])
    assert len(out[0]["token_ids"]) == 4


def test_packed_bf16_linears_give_the_same_tokens_and_logits(tmp_path, tiny_model_dir):
    """Pre-packing bf16 weights for oneDNN (the default on a bf16 CPU), with q/k/v and gate/up merged,
    changes the layout, not the output: the same greedy tokens and logprobs as the plain mapped weights."""
    if not cpu_computes_bf16():
        pytest.skip("this CPU has no native bf16: nothing is packed here")
    _checkpoint(tmp_path, torch.bfloat16, tokenizer_from=tiny_model_dir)

    def run(pack: bool):
        engine = LLMEngine(EngineConfig(model=str(tmp_path), device="cpu", warmup=False, kv_cache_memory_mb=8,
                                        pack_weights=pack, max_num_batched_tokens=16))
        packed = [m for m in engine.model.modules() if getattr(m, "packed", None) is not None]
        seqs = [engine.add_request(list(range(7, 7 + n)), SamplingParams(max_tokens=12, logprobs=0, **GREEDY))
                for n in (5, 40)]
        logprobs = []
        while engine.has_unfinished:
            logprobs += [(ev.request_id, ev.logprob) for ev in engine.step()]
        return len(packed), [list(s.output_token_ids) for s in seqs], logprobs

    n_plain, tokens_plain, lp_plain = run(False)
    n_packed, tokens_packed, lp_packed = run(True)
    assert n_plain == 0 and n_packed == 2 * 4 + 1     # qkv, o, gate_up, down per layer and the LM head
    assert tokens_packed == tokens_plain and lp_packed == lp_plain


def test_sharded_checkpoints_follow_their_index(tmp_path, tiny_model_dir):
    hf = _checkpoint(tmp_path, torch.float32, shard="200KB", tokenizer_from=tiny_model_dir)
    shards = weight_files(tmp_path)
    assert len(shards) > 1 and all(p.name.startswith("model-") for p in shards)
    # Mistral repositories keep their native copy beside the HF shards: never loaded
    (tmp_path / "consolidated.safetensors").write_bytes(b"\0" * 64)
    engine = LLMEngine(EngineConfig(model=str(tmp_path), device="cpu", warmup=False, kv_cache_memory_mb=8))
    ids = [5, 17, 99, 3]
    got = engine.generate([ids], [SamplingParams(max_tokens=5, **GREEDY)])[0]["token_ids"]
    with torch.inference_mode():
        ref = hf.generate(torch.tensor([ids]), max_new_tokens=5, do_sample=False)[0, len(ids):].tolist()
    assert got == ref
    index = tmp_path / "model.safetensors.index.json"
    raw = json.loads(index.read_text())
    raw["weight_map"]["model.norm.weight"] = "model-99999-of-99999.safetensors"
    index.write_text(json.dumps(raw))
    with pytest.raises(ModelLoadError, match="model-99999-of-99999"):
        weight_files(tmp_path)


@pytest.mark.parametrize("method", ["gptq", "awq", "fp8", "bitsandbytes"])
def test_quantized_checkpoints_are_refused_by_name(tmp_path, tiny_model_dir, method):
    shutil.copytree(tiny_model_dir, tmp_path / "m")
    path = tmp_path / "m" / "config.json"
    raw = json.loads(path.read_text())
    raw["quantization_config"] = {"quant_method": method, "bits": 4}
    path.write_text(json.dumps(raw))
    with pytest.raises(UnsupportedModelError) as e:
        ModelConfig.from_dir(tmp_path / "m")
    assert e.value.code == "unsupported_quantization" and method in e.value.message
