"""A GGUF file (llama.cpp's format, what Ollama and LM Studio keep on disk) as a model source.

Everything the engine needs comes from the one file: the config from its ``llama.*`` metadata, the
weights dequantized at load (F32, F16, BF16 and every quantized type the ``gguf`` package can
dequantize), or for the types of ``block_quant.BLOCK_TYPES`` (Q4_0 to Q8_0, Q4_K, Q5_K, Q6_K) kept as
the file's blocks (``layers.block_quant``), with
llama.cpp's Q/K row permutation undone, and the tokenizer rebuilt from its
``tokenizer.ggml.*`` metadata: GPT-2 style BPE (``gpt2``) or SentencePiece (``llama``: Llama-2,
Mistral, TinyLlama). The tokenizer follows the file and llama.cpp's rules, not transformers' GGUF
conversion, which gets SmolLM2 wrong (its EOS, a BOS the file says not to add, no single-digit split)
and SentencePiece text that starts with a space or follows a special token.
"""

from __future__ import annotations

import functools
import math
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import torch

from sits.engine.errors import ModelLoadError, UnsupportedModelError

GGUF_MAGIC = b"GGUF"
_ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM"}
# llama.cpp tensor names -> Hugging Face names ({} is the layer)
_LAYER_TENSORS = {
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj", "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
}
_GLOBAL_TENSORS = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
# token types (gguf.TokenType)
_NORMAL, _UNKNOWN, _CONTROL, _USER_DEFINED, _BYTE = 1, 2, 3, 4, 6
_SPM_DEFAULT_IDS = {"unknown": 0, "bos": 1, "eos": 2}
# llama.cpp's pre-tokenizer regexes by ``tokenizer.ggml.pre``: (split each digit first, the regex)
_GPT2_REGEX = r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)"""
_LLAMA3_REGEX = (r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}|"
                 r" ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_PRE_TOKENIZERS = {"default": (False, _GPT2_REGEX), "gpt-2": (False, _GPT2_REGEX),
                   "smollm": (True, _GPT2_REGEX), "starcoder": (True, _GPT2_REGEX), "refact": (True, _GPT2_REGEX),
                   "llama-bpe": (False, _LLAMA3_REGEX), "llama3": (False, _LLAMA3_REGEX)}


def open_gguf(path: str | Path) -> "GGUFModel | None":
    """The GGUF model at ``path`` (read once per process and kept: config, tokenizer and weights are
    asked for separately), or None when ``path`` is not one."""
    found = gguf_file(path)
    return None if found is None else _open(str(found.resolve()))


@functools.lru_cache(maxsize=2)
def _open(path: str) -> "GGUFModel":
    return GGUFModel(path)


def is_gguf(path: str | Path) -> bool:
    p = Path(path)
    if not p.is_file():
        return False
    with open(p, "rb") as f:
        return f.read(4) == GGUF_MAGIC


def gguf_file(path: str | Path) -> Path | None:
    """The GGUF file ``path`` names: itself, or the only ``*.gguf`` of a directory without safetensors."""
    p = Path(path)
    if p.is_file():
        return p if is_gguf(p) else None
    if p.is_dir() and not any(p.glob("*.safetensors")):
        found = sorted(p.glob("*.gguf"))
        if len(found) == 1 and is_gguf(found[0]):
            return found[0]
    return None


class GGUFModel:
    """One GGUF file, its metadata read once (``gguf_reader``; tensors are views of its memory map)."""

    def __init__(self, path: str | Path):
        from sits.engine.gguf_reader import GGUFFile     # only when a GGUF is loaded: safetensors starts skip gguf

        self.path = Path(path)
        try:
            self.file = GGUFFile(self.path)
        except (ValueError, OSError) as e:
            raise ModelLoadError(f"{self.path}: not a readable GGUF file: {e}", param="model") from None
        self.meta: dict[str, Any] = self.file.metadata
        self.tensors = self.file.tensors
        self.arch = str(self.meta.get("general.architecture", ""))
        if self.arch not in _ARCHITECTURES:
            raise UnsupportedModelError(f"{self.path}: GGUF architecture {self.arch!r} is not supported; SITS runs "
                                        f"{', '.join(sorted(_ARCHITECTURES))}", param="model")

    def _field(self, name: str) -> list:
        return self.meta.get(name) or []

    def _a(self, key: str, default=None):
        return self.meta.get(f"{self.arch}.{key}", default)

    # -- config ----------------------------------------------------------------------------------
    def model_config(self):
        from sits.engine.config import ModelConfig

        heads = int(self._a("attention.head_count"))
        hidden = int(self._a("embedding_length"))
        names = {t.name for t in self.tensors}
        vocab = int(self._a("vocab_size") or len(self._field("tokenizer.ggml.tokens")))
        types = {t.tensor_type.name for t in self.tensors if t.name.endswith(".weight") and "norm" not in t.name}
        low_precision = types - {"F32"}
        raw = {
            "architectures": [_ARCHITECTURES[self.arch]], "vocab_size": vocab, "hidden_size": hidden,
            "intermediate_size": int(self._a("feed_forward_length")), "num_hidden_layers": int(self._a("block_count")),
            "num_attention_heads": heads, "num_key_value_heads": int(self._a("attention.head_count_kv") or heads),
            "head_dim": int(self._a("attention.key_length") or self._a("rope.dimension_count") or hidden // heads),
            "max_position_embeddings": int(self._a("context_length", 2048)),
            "rms_norm_eps": float(self._a("attention.layer_norm_rms_epsilon", 1e-6)),
            "rope_theta": float(self._a("rope.freq_base", 10000.0)),
            "tie_word_embeddings": "output.weight" not in names,
            "bos_token_id": self._special_id("bos"), "eos_token_id": self._special_id("eos"),
            # dequantized weights are fp32, but their precision is the file's: auto may compute in bf16
            "torch_dtype": "bfloat16" if low_precision else "float32",
        }
        if self.arch == "llama":      # a Llama's biases are only known by their tensors
            raw["attention_bias"] = "blk.0.attn_q.bias" in names
            raw["mlp_bias"] = "blk.0.ffn_gate.bias" in names
        if self._a("attention.sliding_window"):
            raw["sliding_window"] = int(self._a("attention.sliding_window"))
        scaling = self._a("rope.scaling.type")
        if scaling and scaling != "none":
            raw["rope_scaling"] = {"rope_type": scaling, "factor": float(self._a("rope.scaling.factor", 1.0)),
                                   "original_max_position_embeddings": int(
                                       self._a("rope.scaling.original_context_length", raw["max_position_embeddings"]))}
        return ModelConfig.from_dict(raw, source=str(self.path))

    # -- weights ---------------------------------------------------------------------------------
    def state_dict(self, dtype: torch.dtype, keep_blocks: bool = False) -> dict[str, Any]:
        """HF-named tensors, dequantized and cast to ``dtype``, Q/K rows back in HF's order (llama.cpp
        permutes them for its ``llama`` architecture only: a ``qwen2`` file keeps HF's rotate-half rows). With
        ``keep_blocks``, the 2-D weights of the types the CPU kernels multiply in place (``BLOCK_TYPES``)
        come as ``BlockWeight``s instead: the file's blocks (views of its map where no row is
        moved), their rows un-permuted as whole rows of blocks."""
        from gguf.quants import dequantize

        from sits.engine.layers.block_quant import BLOCK_TYPES, BlockWeight

        heads = int(self._a("attention.head_count"))
        kv_heads = int(self._a("attention.head_count_kv") or heads)
        out: dict[str, Any] = {}
        for t in self.tensors:
            name = _hf_name(t.name)
            if name is None:
                continue
            shape = [int(d) for d in reversed(t.shape)]          # GGUF lists dimensions fastest first
            if keep_blocks and t.tensor_type.name in BLOCK_TYPES and len(shape) == 2:
                with warnings.catch_warnings():       # a read-only view: the weights are never written to
                    warnings.simplefilter("ignore", UserWarning)
                    blocks = torch.from_numpy(t.data.reshape(shape[0], -1))
                w = _unpermute_rows(name, blocks, heads, kv_heads) if self.arch == "llama" else blocks
                out[name] = BlockWeight(t.tensor_type.name, w.contiguous(), shape[1])
                continue
            try:
                values = dequantize(t.data, t.tensor_type)
            except NotImplementedError:
                raise UnsupportedModelError(f"{self.path}: tensor {t.name} is {t.tensor_type.name}, which the gguf "
                                            "package cannot dequantize", param="model",
                                            code="unsupported_quantization") from None
            values = np.ascontiguousarray(values, dtype=np.float32).reshape(shape)
            w = torch.from_numpy(values if values.flags.writeable else values.copy())   # F32: a read-only map
            if self.arch == "llama":
                w = _unpermute_rows(name, w, heads, kv_heads)
            out[name] = w.to(dtype)
        return out

    def block_tensors(self) -> tuple[int, int]:
        """The values and the bytes of the weights ``state_dict(keep_blocks=True)`` keeps as blocks."""
        from sits.engine.layers.block_quant import BLOCK_TYPES

        kept = [t for t in self.tensors if _hf_name(t.name) is not None and t.tensor_type.name in BLOCK_TYPES
                and len(t.shape) == 2]
        return sum(math.prod(t.shape) for t in kept), sum(t.data.nbytes for t in kept)

    # -- tokenizer -------------------------------------------------------------------------------
    def _special_id(self, name: str) -> int | None:
        """A special token id from the file, or llama.cpp's default for a SentencePiece vocabulary
        (<unk>, <s>, </s> = 0, 1, 2), which older Llama conversions rely on."""
        value = self.meta.get(f"tokenizer.ggml.{name}_token_id")
        if value is None and self.meta.get("tokenizer.ggml.model") == "llama":
            value = _SPM_DEFAULT_IDS.get(name)
        return None if value is None else int(value)

    def tokenizer(self):
        from tokenizers import AddedToken, processors

        from sits.engine.tokenizer import Tokenizer

        kind = self.meta.get("tokenizer.ggml.model")
        if kind not in ("gpt2", "llama"):
            raise UnsupportedModelError(f"{self.path}: tokenizer model {kind!r} is not supported yet (GPT-2 style "
                                        "BPE ('gpt2') and SentencePiece ('llama') vocabularies are)", param="model")
        spm = kind == "llama"
        tokens = [str(t) for t in self._field("tokenizer.ggml.tokens")]
        types = [int(t) for t in self._field("tokenizer.ggml.token_type")] or [_NORMAL] * len(tokens)

        def token(name: str) -> tuple[int | None, str | None]:
            i = self._special_id(name)
            return (i, tokens[i]) if i is not None and 0 <= i < len(tokens) else (None, None)

        bos_id, bos = token("bos")
        eos_id, eos = token("eos")
        pad_id, pad = token("padding")
        backend = self._spm_backend(tokens, types, token("unknown")[1]) if spm else self._gpt2_backend(tokens)
        # llama.cpp matches control and unknown tokens in the text as themselves, user-defined ones always
        backend.add_special_tokens([AddedToken(tok, special=True, normalized=False)
                                    for tok, ty in zip(tokens, types) if ty in (_CONTROL, _UNKNOWN)])
        backend.add_tokens([AddedToken(tok, special=False, normalized=False)
                            for tok, ty in zip(tokens, types) if ty == _USER_DEFINED])
        # llama.cpp adds BOS to a SentencePiece vocabulary unless the file says not to
        add_bos = bool(self.meta.get("tokenizer.ggml.add_bos_token", spm)) and bos is not None
        add_eos = bool(self.meta.get("tokenizer.ggml.add_eos_token", False)) and eos is not None
        single = " ".join([f"{bos}:0"] * add_bos + ["$A:0"] + [f"{eos}:0"] * add_eos)
        specials = [(t, i) for t, i, on in ((bos, bos_id, add_bos), (eos, eos_id, add_eos)) if on]
        if specials:
            backend.post_processor = processors.TemplateProcessing(single=single, special_tokens=specials)
        elif not spm:
            backend.post_processor = processors.ByteLevel(trim_offsets=False)
        return Tokenizer(backend, eos_token_ids=[eos_id] if eos_id is not None else [], bos_token_id=bos_id,
                         pad_token_id=pad_id, bos_token=bos, eos_token=eos, pad_token=pad,
                         chat_template=self.meta.get("tokenizer.chat_template"), source=str(self.path))

    def _gpt2_backend(self, tokens: list[str]):
        import tokenizers
        from tokenizers import decoders, models, pre_tokenizers

        pre = str(self.meta.get("tokenizer.ggml.pre", "default"))
        if pre not in _PRE_TOKENIZERS:
            raise UnsupportedModelError(f"{self.path}: pre-tokenizer {pre!r} is not known; known: "
                                        f"{', '.join(sorted(_PRE_TOKENIZERS))}", param="model")
        merges = [tuple(str(m).split(" ", 1)) for m in self._field("tokenizer.ggml.merges")]
        vocab = {tok: i for i, tok in enumerate(tokens)}
        backend = tokenizers.Tokenizer(models.BPE(vocab, merges, fuse_unk=False, byte_fallback=False))
        split_digits, regex = _PRE_TOKENIZERS[pre]
        steps = [pre_tokenizers.Digits(individual_digits=True)] if split_digits else []
        steps += [pre_tokenizers.Split(tokenizers.Regex(regex), behavior="isolated"),
                  pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)]
        backend.pre_tokenizer = pre_tokenizers.Sequence(steps)
        backend.decoder = decoders.ByteLevel()
        return backend

    def _spm_backend(self, tokens: list[str], types: list[int], unk: str | None):
        """llama.cpp's SPM tokenizer as a ``tokenizers`` BPE: each text fragment (the text between
        special tokens) gets a leading space, spaces become ``▁``, the adjacent pair forming the
        best-scoring token merges first, and characters left outside the vocabulary fall back to
        ``<0xNN>`` byte tokens. A normalizer rather than ``Metaspace`` adds the space, because
        ``Metaspace`` adds none to text that already starts with one, and llama.cpp does."""
        import tokenizers
        from tokenizers import decoders, models, normalizers

        scores = [float(s) for s in self._field("tokenizer.ggml.scores")] or [0.0] * len(tokens)
        vocab = {tok: i for i, tok in enumerate(tokens)}
        backend = tokenizers.Tokenizer(models.BPE(vocab, _spm_merges(tokens, types, scores), unk_token=unk,
                                                  byte_fallback=True, fuse_unk=False))
        space_prefix = bool(self.meta.get("tokenizer.ggml.add_space_prefix", True))
        backend.normalizer = normalizers.Sequence([normalizers.Prepend("\u2581")] * space_prefix
                                                  + [normalizers.Replace(" ", "\u2581")])
        # decoding drops the space the encoder added (once, at the start), as SentencePiece does
        backend.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(),
                                             decoders.Fuse()] + [decoders.Strip(" ", 1, 0)] * space_prefix)
        return backend


def _spm_merges(tokens: list[str], types: list[int], scores: list[float]) -> list[tuple[str, str]]:
    """Every way to make a token from two tokens, the best-scoring result first: BPE then merges what
    llama.cpp's SPM loop merges (equal scores aside: llama.cpp takes the leftmost pair, BPE the
    earlier listed). Byte, control and unknown tokens are never built from text."""
    ids = {tok: i for i, tok in enumerate(tokens) if types[i] not in (_BYTE, _CONTROL, _UNKNOWN)}
    found = []
    for tok, i in ids.items():
        for cut in range(1, len(tok)):
            if tok[:cut] in ids and tok[cut:] in ids:
                found.append((-scores[i], i, cut))
    found.sort()
    return [(tokens[i][:cut], tokens[i][cut:]) for _, i, cut in found]


def _hf_name(gguf_name: str) -> str | None:
    parts = gguf_name.split(".")
    if parts[0] == "blk" and len(parts) == 4 and parts[2] in _LAYER_TENSORS:
        return f"model.layers.{parts[1]}.{_LAYER_TENSORS[parts[2]]}.{parts[3]}"
    if len(parts) == 2 and parts[0] in _GLOBAL_TENSORS:
        return f"{_GLOBAL_TENSORS[parts[0]]}.{parts[1]}"
    return None        # e.g. rope_freqs: recomputed from the config


def _unpermute_rows(name: str, w: torch.Tensor, heads: int, kv_heads: int) -> torch.Tensor:
    """``w`` with llama.cpp's Q/K row permutation undone if ``name`` is a query or key projection's
    weight or bias (rows of values, or rows of blocks: the permutation moves whole rows)."""
    if name.endswith(("q_proj.weight", "q_proj.bias")):
        return _unpermute(w, heads)
    if name.endswith(("k_proj.weight", "k_proj.bias")):
        return _unpermute(w, kv_heads)
    return w


def _unpermute(w: torch.Tensor, heads: int) -> torch.Tensor:
    """Undo llama.cpp's ``permute`` of Q/K rows (HF's rotate-half layout -> interleaved pairs)."""
    rows = w.shape[0]
    return w.reshape(heads, rows // heads // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)
