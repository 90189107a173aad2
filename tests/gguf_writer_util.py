"""Small GGUF files written the way llama.cpp's convert_hf_to_gguf.py writes a Llama, for tests: Q/K
rows permuted, 2-D weights in a chosen tensor type, norms in F32, and a SentencePiece vocabulary.

Independent of ``sits.engine.gguf_model`` on purpose (its own name table and permutation), so a
mistake in the loader is not mirrored here. Also a line-for-line Python port of llama.cpp's SPM
tokenizer (``llm_tokenizer_spm_session``), the reference the SITS tokenizer is checked against.
"""

from __future__ import annotations

import heapq
from pathlib import Path
from typing import Callable

import numpy as np
import torch

import gguf
from gguf import GGMLQuantizationType as Q
from gguf import TokenType

# what gguf.quants can only dequantize: written here as random, well-formed blocks
K_QUANTS = (Q.Q4_K, Q.Q5_K, Q.Q6_K)
_LAYER = {"self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
          "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
          "mlp.down_proj": "ffn_down", "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm"}
_GLOBAL = {"model.embed_tokens": "token_embd", "model.norm": "output_norm", "lm_head": "output"}

# -- a small SentencePiece vocabulary ---------------------------------------------------------------
# merges in training order (best first); every token they make is reachable from single characters
SPM_MERGES = [("▁", "t"), ("h", "e"), ("▁t", "he"), ("▁", "a"), ("i", "n"), ("▁", "in"), ("e", "r"),
              ("l", "l"), ("▁", "he"), ("ll", "o"), ("▁he", "llo"), ("▁", "w"), ("o", "r"),
              ("▁w", "or"), ("l", "d"), ("▁wor", "ld"), ("▁", "1"), ("2", "3"), ("c", "a"), ("b", "c"),
              ("▁", "i"), ("▁i", "s"), ("▁", "▁"), ("▁▁", "▁▁"), ("o", "g"), ("▁", "d"),
              ("▁d", "og")]
SPM_CHARS = list("▁abcdefghijklmnopqrstuvwxyz0123456789.,!?'-")
USER_DEFINED = "<tool>"


def spm_vocab() -> tuple[list[str], list[float], list[int]]:
    """Tokens, scores and types laid out as in a Llama-2 GGUF: <unk>, <s>, </s>, the 256 byte tokens,
    then pieces by score (merged pieces, then single characters), and one user-defined token."""
    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)]
    types = [TokenType.UNKNOWN, TokenType.CONTROL, TokenType.CONTROL] + [TokenType.BYTE] * 256
    scores = [0.0] * len(tokens)
    pieces = [(a + b, -float(rank)) for rank, (a, b) in enumerate(SPM_MERGES)]
    pieces += [(c, -1000.0 - i) for i, c in enumerate(SPM_CHARS)]
    tokens += [p for p, _ in pieces] + [USER_DEFINED]
    scores += [s for _, s in pieces] + [0.0]
    types += [TokenType.NORMAL] * len(pieces) + [TokenType.USER_DEFINED]
    return tokens, scores, [int(t) for t in types]


def llama_cpp_spm(text: str, tokens: list[str], scores: list[float], add_space_prefix: bool = True) -> list[int]:
    """llama.cpp's SPM tokenization of one text fragment (text between special tokens), ported from
    ``llm_tokenizer_spm_session::tokenize``: a space prefix, spaces as ``▁``, then the adjacent pair
    whose concatenation is the best-scoring token merges first (ties: the leftmost), and whatever is
    left outside the vocabulary goes out as ``<0xNN>`` byte tokens."""
    vocab = {t: i for i, t in enumerate(tokens)}
    text = ((" " if add_space_prefix else "") + text).replace(" ", "▁")
    sym = [[c, i - 1, i + 1 if i + 1 < len(text) else -1] for i, c in enumerate(text)]   # text, prev, next
    queue: list[tuple[float, int, int, int]] = []

    def try_add_bigram(left: int, right: int) -> None:
        if left == -1 or right == -1:
            return
        merged = sym[left][0] + sym[right][0]
        if merged in vocab:
            heapq.heappush(queue, (-scores[vocab[merged]], left, right, len(merged)))

    for i in range(1, len(sym)):
        try_add_bigram(i - 1, i)
    while queue:
        _, left, right, size = heapq.heappop(queue)
        if not sym[left][0] or not sym[right][0] or len(sym[left][0]) + len(sym[right][0]) != size:
            continue
        sym[left][0] += sym[right][0]
        sym[right][0] = ""
        sym[left][2] = sym[right][2]
        if sym[right][2] >= 0:
            sym[sym[right][2]][1] = left
        try_add_bigram(sym[left][1], left)
        try_add_bigram(left, sym[left][2])
    out, i = [], 0 if sym else -1
    while i != -1:
        piece = sym[i][0]
        out += [vocab[piece]] if piece in vocab else [vocab[f"<0x{b:02X}>"] for b in piece.encode()]
        i = sym[i][2]
    return out


# -- weights ----------------------------------------------------------------------------------------
def permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """convert_hf_to_gguf.py's ``LlamaModel.permute``: HF's rotate-half rows -> llama.cpp's pairs."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def unpermute(w: np.ndarray, n_head: int) -> np.ndarray:
    return w.reshape(n_head, w.shape[0] // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def random_kquant(rows: int, cols: int, qtype: Q, rng: np.random.Generator) -> np.ndarray:
    """Random but well-formed Q4_K / Q5_K / Q6_K blocks (the gguf package cannot quantize K-quants): random
    quants and sub-block scales, super-block scales chosen so values are of weight-like size."""
    block, size = gguf.GGML_QUANT_SIZES[qtype]
    n = rows * cols // block
    raw = rng.integers(0, 256, (n, size), dtype=np.uint8)
    d = rng.uniform(1e-4, 3e-4, n).astype(np.float16).view(np.uint8).reshape(n, 2)
    if qtype in (Q.Q4_K, Q.Q5_K):  # d, dmin (f16), 12 bytes of 6-bit scales and mins, (Q5_K: 32 bytes of fifth
        #                            bits), 128 bytes of 4-bit quants
        raw[:, 0:2] = d
        raw[:, 2:4] = (d.view(np.float16) * np.float16(7.5)).view(np.uint8)
    elif qtype == Q.Q6_K:          # 128 + 64 bytes of 6-bit quants, 16 int8 scales, d (f16)
        raw[:, 192:208] = rng.integers(-32, 33, (n, 16)).astype(np.int8).view(np.uint8)
        raw[:, 208:210] = d
    else:
        raise ValueError(qtype)
    return raw.reshape(rows, cols // block * size)


def add_spm_vocab(w: gguf.GGUFWriter, *, add_bos: bool | None = True, add_space_prefix: bool | None = None,
                  model: str = "llama") -> None:
    """The ``spm_vocab`` tokenizer as ``tokenizer.ggml.*`` metadata; a flag left None is not written
    (llama.cpp's default applies)."""
    tokens, scores, types = spm_vocab()
    w.add_tokenizer_model(model)
    w.add_token_list(tokens)
    w.add_token_scores(scores)
    w.add_token_types(types)
    w.add_unk_token_id(0)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    if add_bos is not None:
        w.add_add_bos_token(add_bos)
    w.add_add_eos_token(False)
    if add_space_prefix is not None:
        w.add_add_space_prefix(add_space_prefix)


def write_vocab_gguf(path: str | Path, **vocab_flags) -> None:
    """A GGUF that only a tokenizer is read from: the vocabulary and a token embedding."""
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_block_count(1)
    add_spm_vocab(w, **vocab_flags)
    w.add_tensor("token_embd.weight", np.zeros((len(spm_vocab()[0]), 8), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def _gguf_name(hf_name: str) -> str:
    stem, kind = hf_name.rsplit(".", 1)
    if stem.startswith("model.layers."):
        _, _, layer, part = stem.split(".", 3)
        return f"blk.{layer}.{_LAYER[part]}.{kind}"
    return f"{_GLOBAL[stem]}.{kind}"


def write_llama_gguf(path: str | Path, model, qtype: Q | Callable[[str], Q], *,
                     seed: int = 0, arch: str = "llama") -> dict[str, torch.Tensor]:
    """Write ``model`` (a transformers LlamaForCausalLM, or Qwen2ForCausalLM with ``arch="qwen2"``) as
    llama.cpp would, 2-D weights in ``qtype`` (or ``qtype(gguf_name)``), with the ``spm_vocab``
    tokenizer; Q/K rows (and biases) permuted for ``llama`` only (convert_hf_to_gguf.py's Qwen2 keeps
    HF's order).
    Returns the weights the file really holds, HF-named and HF-ordered in fp32: what a correct loader
    must produce."""
    cfg = model.config
    type_of = qtype if callable(qtype) else (lambda _name: qtype)
    rng = np.random.default_rng(seed)
    assert cfg.vocab_size == len(spm_vocab()[0])
    w = gguf.GGUFWriter(str(path), arch)
    w.add_name(f"tiny-test-{arch}")
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_block_count(cfg.num_hidden_layers)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_rope_dimension_count(cfg.hidden_size // cfg.num_attention_heads)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_rope_freq_base(getattr(cfg, "rope_theta", None) or cfg.rope_parameters["rope_theta"])   # transformers 4 / 5
    w.add_vocab_size(cfg.vocab_size)
    add_spm_vocab(w)
    held: dict[str, torch.Tensor] = {}
    for hf_name, param in model.state_dict().items():
        if hf_name == "lm_head.weight" and cfg.tie_word_embeddings:
            continue
        name = _gguf_name(hf_name)
        data = param.detach().float().numpy()
        heads = {"attn_q": cfg.num_attention_heads, "attn_k": cfg.num_key_value_heads}.get(name.split(".")[-2])
        if arch != "llama":
            heads = None
        if heads:
            data = permute(data, heads)
        t = Q.F32 if data.ndim == 1 else type_of(name)
        raw = random_kquant(*data.shape, t, rng) if t in K_QUANTS else gguf.quants.quantize(data, t)
        w.add_tensor(name, raw, raw_dtype=None if t in (Q.F32, Q.F16) else t)
        back = gguf.quants.dequantize(raw, t).astype(np.float32).reshape(data.shape)
        held[hf_name] = torch.from_numpy(np.ascontiguousarray(unpermute(back, heads) if heads else back))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return held
