"""Write a random-weight GGUF shaped like a real model, its weights in llama.cpp's Q4_K_M mix (Q4_K,
with Q6_K for the LM head and for attn_v and ffn_down in the layers llama.cpp gives more bits), to time
K-quant blocks against the same file dequantized at load. The weights are random but well-formed
blocks (the gguf package cannot quantize K-quants); the vocabulary is the tests' small SentencePiece
one, so the embedding and LM head are tiny next to the layers.

    .venv/bin/python bench/kquant_gguf.py OUT.gguf [llama-3.2-1b|qwen-0.5b-k]
    .venv/bin/sits bench step --model OUT.gguf --device cpu --dtype float32 --batch-sizes 1,4,16 --no-hf
"""

import sys
from pathlib import Path

import numpy as np

import gguf
from gguf import GGMLQuantizationType as Q

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from gguf_writer_util import add_spm_vocab, random_kquant, spm_vocab  # noqa: E402

SHAPES = {
    # hidden, intermediate, layers, heads, kv heads
    "llama-3.2-1b": (2048, 8192, 16, 32, 8),
    "qwen-0.5b-k": (1024, 4864, 24, 16, 2),      # Qwen2.5-0.5B's shape with a K-quant-friendly hidden size
}


def more_bits(layer: int, layers: int) -> bool:
    """llama.cpp's use_more_bits: the first and last eighth of the layers and every third between"""
    return layer < layers // 8 or layer >= 7 * layers // 8 or (layer - layers // 8) % 3 == 2


def main(out: str, shape: str = "llama-3.2-1b") -> None:
    hidden, inter, layers, heads, kv_heads = SHAPES[shape]
    head_dim = hidden // heads
    vocab = len(spm_vocab()[0])
    rng = np.random.default_rng(0)
    w = gguf.GGUFWriter(out, "llama")
    w.add_name(f"random-{shape}-q4_k_m")
    w.add_context_length(4096)
    w.add_embedding_length(hidden)
    w.add_block_count(layers)
    w.add_feed_forward_length(inter)
    w.add_rope_dimension_count(head_dim)
    w.add_head_count(heads)
    w.add_head_count_kv(kv_heads)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_rope_freq_base(500000.0)
    w.add_vocab_size(vocab)
    add_spm_vocab(w)

    def put(name: str, rows: int, cols: int, qtype: Q) -> None:
        w.add_tensor(name, random_kquant(rows, cols, qtype, rng), raw_dtype=qtype)

    ones = np.ones(hidden, dtype=np.float32)
    put("token_embd.weight", vocab, hidden, Q.Q4_K)
    put("output.weight", vocab, hidden, Q.Q6_K)
    w.add_tensor("output_norm.weight", ones)
    for i in range(layers):
        extra = more_bits(i, layers)
        put(f"blk.{i}.attn_q.weight", hidden, hidden, Q.Q4_K)
        put(f"blk.{i}.attn_k.weight", kv_heads * head_dim, hidden, Q.Q4_K)
        put(f"blk.{i}.attn_v.weight", kv_heads * head_dim, hidden, Q.Q6_K if extra else Q.Q4_K)
        put(f"blk.{i}.attn_output.weight", hidden, hidden, Q.Q4_K)
        put(f"blk.{i}.ffn_gate.weight", inter, hidden, Q.Q4_K)
        put(f"blk.{i}.ffn_up.weight", inter, hidden, Q.Q4_K)
        put(f"blk.{i}.ffn_down.weight", hidden, inter, Q.Q6_K if extra else Q.Q4_K)
        w.add_tensor(f"blk.{i}.attn_norm.weight", ones)
        w.add_tensor(f"blk.{i}.ffn_norm.weight", ones)
        print(f"\rlayer {i + 1}/{layers}", end="", file=sys.stderr, flush=True)
    print(file=sys.stderr)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file(progress=True)
    w.close()
    print(f"{out}: {Path(out).stat().st_size / 2**20:.0f} MiB")


if __name__ == "__main__":
    main(*sys.argv[1:])
