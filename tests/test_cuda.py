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
    return LLMEngine(EngineConfig(model=model, device=device, warmup=False, num_kv_blocks=128, block_size=16,
                                  max_num_batched_tokens=64, **kw))


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
