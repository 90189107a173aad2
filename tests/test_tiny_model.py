"""The offline model builder: a directory SITS and transformers both load, reproducible per seed."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from tokenizers import Tokenizer

from sits.engine.config import ModelConfig
from sits.engine.models.llama import LlamaForCausalLM
from sits.modelbuild.tiny import PRESETS, SPECIAL_TOKENS, build_tiny_model

FILES = ["config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json",
         "generation_config.json", "build_info.json"]
PARAM_RANGES = {"tiny": (5e6, 10e6), "small": (20e6, 30e6), "base": (90e6, 130e6)}


@pytest.fixture
def tiny_dir(tiny_model_dir: str) -> Path:
    """conftest's session build: preset "tiny", seed 0."""
    return Path(tiny_model_dir)


def test_directory_is_complete_and_parses(tiny_dir: Path) -> None:
    assert all((tiny_dir / name).is_file() for name in FILES)
    cfg = ModelConfig.from_dir(tiny_dir)
    preset = PRESETS["tiny"]
    assert cfg.architecture == "LlamaForCausalLM"
    tok = Tokenizer.from_file(str(tiny_dir / "tokenizer.json"))
    assert cfg.vocab_size == preset["vocab_size"] == tok.get_vocab_size()
    assert cfg.num_key_value_heads < cfg.num_attention_heads
    assert cfg.tie_word_embeddings and cfg.max_position_embeddings == 2048 and cfg.rope_theta == 10000.0
    assert cfg.eos_token_id and cfg.bos_token_id == 0
    info = json.loads((tiny_dir / "build_info.json").read_text())
    lo, hi = PARAM_RANGES["tiny"]
    assert lo <= info["num_parameters"] <= hi


def test_native_model_loads_weights(tiny_dir: Path) -> None:
    model = LlamaForCausalLM(ModelConfig.from_dir(tiny_dir))
    state = load_file(str(tiny_dir / "model.safetensors"))
    assert "lm_head.weight" not in state  # tied: saved once, as embed_tokens
    result = model.load_state_dict(state, strict=False)
    assert result.missing_keys == ["lm_head.weight"] and not result.unexpected_keys
    assert sum(p.numel() for p in model.parameters()) == json.loads(
        (tiny_dir / "build_info.json").read_text())["num_parameters"]
    norms = [v for k, v in state.items() if k.endswith("norm.weight")]
    assert norms and all(torch.equal(v, torch.ones_like(v)) for v in norms)
    assert abs(state["model.embed_tokens.weight"].std().item() - 0.02) < 1e-3


@pytest.mark.parametrize("preset", sorted(PRESETS))
def test_preset_sizes(preset: str) -> None:
    p = PRESETS[preset]
    cfg = ModelConfig(architecture="LlamaForCausalLM", vocab_size=p["vocab_size"], hidden_size=p["hidden_size"],
                      intermediate_size=p["intermediate_size"], num_hidden_layers=p["num_hidden_layers"],
                      num_attention_heads=p["num_attention_heads"], num_key_value_heads=p["num_key_value_heads"],
                      head_dim=p["hidden_size"] // p["num_attention_heads"], max_position_embeddings=2048,
                      tie_word_embeddings=True)
    with torch.device("meta"):
        n = sum(t.numel() for t in LlamaForCausalLM(cfg).parameters())
    lo, hi = PARAM_RANGES[preset]
    assert lo <= n <= hi


def test_same_seed_is_byte_identical(tiny_dir: Path, tmp_path: Path) -> None:
    again = build_tiny_model(tmp_path / "again", progress=None)
    for name in FILES:
        assert (again / name).read_bytes() == (tiny_dir / name).read_bytes(), name


def test_other_seed_changes_weights_not_tokenizer(tiny_dir: Path, tmp_path: Path) -> None:
    other = build_tiny_model(tmp_path / "other", seed=1, progress=None)
    assert (other / "tokenizer.json").read_bytes() == (tiny_dir / "tokenizer.json").read_bytes()
    a, b = load_file(str(tiny_dir / "model.safetensors")), load_file(str(other / "model.safetensors"))
    assert a.keys() == b.keys()
    assert not torch.equal(a["model.embed_tokens.weight"], b["model.embed_tokens.weight"])


@pytest.mark.parametrize("text", [
    "Hello, world! def f(x):\n\treturn x ** 2  # trailing  spaces  ",
    "你好，世界。这是一个测试。",
    "emoji 🎉👍🏽 and a family 👨‍👩‍👧 🇯🇵",
    " leading space, NUL \x00 and \u00e9\u0301",
])
def test_tokenizer_round_trips(tiny_dir: Path, text: str) -> None:
    tok = Tokenizer.from_file(str(tiny_dir / "tokenizer.json"))
    ids = tok.encode(text).ids
    assert ids and tok.decode(ids) == text


def test_special_tokens_have_fixed_ids(tiny_dir: Path) -> None:
    tok = Tokenizer.from_file(str(tiny_dir / "tokenizer.json"))
    assert [tok.token_to_id(t) for t in SPECIAL_TOKENS] == list(range(len(SPECIAL_TOKENS)))
    assert tok.encode("<|im_start|>user").ids[0] == SPECIAL_TOKENS.index("<|im_start|>")


def test_transformers_loads_model_and_tokenizer(tiny_dir: Path) -> None:
    transformers = pytest.importorskip("transformers")
    hf = transformers.LlamaForCausalLM.from_pretrained(tiny_dir)
    assert hf.lm_head.weight.data_ptr() == hf.model.embed_tokens.weight.data_ptr()
    native = LlamaForCausalLM(ModelConfig.from_dir(tiny_dir))
    native.load_state_dict(load_file(str(tiny_dir / "model.safetensors")), strict=False)
    ids = torch.randint(0, hf.config.vocab_size, (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(native.forward_dense(ids), hf(ids).logits, rtol=1e-4, atol=1e-4)

    tok = transformers.AutoTokenizer.from_pretrained(tiny_dir)
    assert (tok.bos_token_id, tok.eos_token_id, tok.pad_token_id) == (0, 1, 2)
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi 你好"}]
    rendered = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert rendered == ("<|im_start|>system\nBe brief.<|im_end|>\n"
                        "<|im_start|>user\nHi 你好<|im_end|>\n<|im_start|>assistant\n")
    assert tok.decode(tok(rendered)["input_ids"]) == rendered


def test_training_lowers_loss(tmp_path: Path) -> None:
    messages: list[str] = []
    # Small steps on one thread: 3 s holds dozens of them even while other jobs keep the cores busy.
    out = build_tiny_model(tmp_path / "trained", train_seconds=3, progress=messages.append,
                           batch_size=2, seq_len=32, threads=1)
    assert any(m.startswith("train:") for m in messages) and "saved" in messages[-1]
    assert ModelConfig.from_dir(out).vocab_size == PRESETS["tiny"]["vocab_size"]
    curve = json.loads((out / "build_info.json").read_text())["loss_curve"]
    assert curve[0]["step"] == 1
    if curve[-1]["step"] < 5:
        pytest.skip(f"CPU too busy to judge the loss: {curve[-1]['step']} training steps in 3 s")
    assert len(curve) >= 2 and curve[-1]["loss"] < curve[0]["loss"]


def test_refuses_existing_model_without_overwrite(tiny_dir: Path, tmp_path: Path) -> None:
    with pytest.raises(FileExistsError, match="overwrite=True"):
        build_tiny_model(tiny_dir, progress=None)
    target = tmp_path / "m"
    build_tiny_model(target, progress=None)
    build_tiny_model(target, seed=3, progress=None, overwrite=True)
    assert json.loads((target / "build_info.json").read_text())["seed"] == 3


def test_unknown_preset_lists_presets(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="tiny, small, base"):
        build_tiny_model(tmp_path, preset="huge", progress=None)


@pytest.mark.slow
@pytest.mark.parametrize("preset", ["small", "base"])
def test_larger_presets_get_their_full_vocabulary(preset: str, tmp_path: Path) -> None:
    out = build_tiny_model(tmp_path / preset, preset=preset, progress=None)
    assert ModelConfig.from_dir(out).vocab_size == PRESETS[preset]["vocab_size"]
    lo, hi = PARAM_RANGES[preset]
    assert lo <= json.loads((out / "build_info.json").read_text())["num_parameters"] <= hi
