"""Native PyTorch Llama family (Llama 2/3, Mistral, Qwen2) that attends through a paged KV cache.

Module names follow Hugging Face's so a ``model.safetensors`` state dict loads as is. Two forward
paths share every layer: ``forward`` (flat varlen batch of new tokens, KV read and written through
block tables, used when serving) and ``forward_dense`` (plain causal [B, L], used for training,
parity checks and baselines).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from sits.engine.config import ModelConfig
from sits.engine.errors import UnsupportedModelError
from sits.engine.layers import cpu_attention, cpu_kernels, paged_attention
from sits.engine.layers.attention import decode_attention
from sits.engine.layers.block_quant import BlockLinear
from sits.engine.layers.linear import Linear, fuse_linears, use_cpu_kernel


@dataclass(slots=True)
class PrefillSpan:
    """One sequence's chunk of new tokens (>1 token, or its first) in the flat batch."""

    start: int               # offset of its first new token in the flat batch
    end: int                 # one past its last new token
    context_len: int         # tokens in the KV cache after this step (cached + new)
    block_table: torch.Tensor  # [num_blocks] long


@dataclass(slots=True)
class AttentionMetadata:
    """Where each new token's K/V goes and what each query attends to, for one step: for the
    reference path (``prefills`` and the ``decode_*`` fields), or for the paged kernels (``paged``)."""

    slot_mapping: torch.Tensor            # [T] long: flat KV slot of each new token (-1: none, kernels only)
    prefills: list[PrefillSpan] = ()
    decode_index: torch.Tensor | None = None      # [Bd] long: positions in the flat batch of 1-token decodes
    decode_block_tables: torch.Tensor | None = None  # [Bd, max_blocks] long (padded with block 0)
    decode_mask: torch.Tensor | None = None       # [Bd, 1, 1, max_blocks*block_size] bool (True: attend)
    decode_window_mask: torch.Tensor | None = None  # the same, limited to the model's sliding window
    decode_context_lens: torch.Tensor | None = None  # [Bd] long, set instead of the masks: the C++ kernel
    paged: paged_attention.PagedMetadata | None = None  # set: attention runs in the paged kernels


def window_mask(q_pos: torch.Tensor, k_pos: torch.Tensor, window: int | None) -> torch.Tensor:
    """Causal mask [len(q), len(k)] (True: attend), limited to the last ``window`` positions as
    transformers' ``sliding_window_overlay`` (a query sees keys with ``q - k < window``)."""
    mask = q_pos[:, None] >= k_pos[None, :]
    if window is not None:
        mask &= q_pos[:, None] - k_pos[None, :] < window
    return mask


def _rope_inv_freq(cfg: ModelConfig) -> tuple[torch.Tensor, float]:
    """Inverse frequencies and attention scaling for the config's RoPE variant."""
    dim = cfg.head_dim
    inv_freq = 1.0 / (cfg.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim))
    scaling = cfg.rope_scaling or {}
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if kind == "default":
        return inv_freq, 1.0
    if kind == "linear":
        return inv_freq / float(scaling["factor"]), 1.0
    if kind == "llama3":
        factor = float(scaling["factor"])
        low = float(scaling.get("low_freq_factor", 1.0))
        high = float(scaling.get("high_freq_factor", 4.0))
        orig = float(scaling["original_max_position_embeddings"])
        low_wavelen, high_wavelen = orig / low, orig / high
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
        smooth = (orig / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        is_medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
        return torch.where(is_medium, smoothed, scaled), 1.0
    if kind == "yarn":
        return _yarn_inv_freq(cfg, scaling)
    raise UnsupportedModelError(f"rope_scaling type {kind!r} is not supported (default, linear, llama3, yarn)",
                                param="rope_scaling")


def _yarn_inv_freq(cfg: ModelConfig, scaling: dict) -> tuple[torch.Tensor, float]:
    """YaRN (Qwen2.5's long context): frequencies blended between interpolated and extrapolated by a
    ramp over the dimensions, and an attention scaling; as transformers' ``_compute_yarn_parameters``."""
    dim, base = cfg.head_dim, cfg.rope_theta
    original = float(scaling.get("original_max_position_embeddings") or cfg.max_position_embeddings)
    factor = scaling.get("factor")
    factor = float(factor) if factor is not None else cfg.max_position_embeddings / original

    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    attention = scaling.get("attention_factor")
    if attention is None:
        m, m_all = scaling.get("mscale"), scaling.get("mscale_all_dim")
        attention = mscale(factor, m) / mscale(factor, m_all) if m and m_all else mscale(factor)
    beta_fast, beta_slow = scaling.get("beta_fast") or 32, scaling.get("beta_slow") or 1

    def correction_dim(rotations: float) -> float:
        return dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    pos_freqs = base ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim)
    extrapolation = 1 - ramp
    inv_freq = (1.0 / (factor * pos_freqs)) * (1 - extrapolation) + (1.0 / pos_freqs) * extrapolation
    return inv_freq.double(), float(attention)


class RotaryEmbedding(nn.Module):
    def __init__(self, cfg: ModelConfig, max_positions: int):
        super().__init__()
        inv_freq, self.attention_scaling = _rope_inv_freq(cfg)
        t = torch.arange(max_positions, dtype=torch.float64)
        freqs = torch.outer(t, inv_freq)
        emb = torch.cat((freqs, freqs), dim=-1)
        self.register_buffer("cos", (emb.cos() * self.attention_scaling).float(), persistent=False)
        self.register_buffer("sin", (emb.sin() * self.attention_scaling).float(), persistent=False)

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        return self.cos[positions].to(dtype), self.sin[positions].to(dtype)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [..., T, H, D]; cos/sin: [..., T, D]."""
    cos, sin = cos.unsqueeze(-2), sin.unsqueeze(-2)
    return x * cos + _rotate_half(x) * sin


class Embedding(nn.Module):
    """``nn.Embedding`` without the random init (see ``layers.linear.Linear``)."""

    def __init__(self, num_embeddings: int, dim: int):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num_embeddings, dim))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(ids, self.weight)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps
        self.cpu_kernel = False  # add + norm in one C++ call (``use_cpu_kernels``)

    def with_residual(self, x: torch.Tensor, residual: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """The pre-norm decoder's ``h = residual + x; norm(h)``: returns ``(norm(h), h)`` (``h`` is ``x``
        when there is no residual yet). Through the kernel, ``h`` is ``residual``, added into in place."""
        if (self.cpu_kernel and x.dtype == torch.float32 and self.weight.dtype == torch.float32
                and not torch.is_grad_enabled()):
            if residual is None:
                return cpu_kernels.loaded().rms_norm(x, self.weight, self.eps), x
            return cpu_kernels.loaded().rms_norm(x, self.weight, self.eps, residual), residual
        h = x if residual is None else residual + x
        return self(h), h

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype == torch.float32 and self.weight.dtype == torch.float32:   # the same sums, one call
            return F.rms_norm(x, self.weight.shape, self.weight, self.eps)
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int = 0):
        super().__init__()
        self.window = cfg.layer_window(layer)
        self.num_heads = cfg.num_attention_heads
        self.num_kv_heads = cfg.num_key_value_heads
        self.head_dim = cfg.head_dim
        bias = cfg.attention_bias
        self.q_proj = Linear(cfg.hidden_size, self.num_heads * self.head_dim, bias=bias)
        self.k_proj = Linear(cfg.hidden_size, self.num_kv_heads * self.head_dim, bias=bias)
        self.v_proj = Linear(cfg.hidden_size, self.num_kv_heads * self.head_dim, bias=bias)
        self.o_proj = Linear(self.num_heads * self.head_dim, cfg.hidden_size, bias=cfg.o_proj_bias)
        self.gqa = self.num_heads != self.num_kv_heads
        self.scale = self.head_dim ** -0.5          # SDPA's default, which the reference path uses
        self.qkv_proj: Linear | None = None     # q|k|v in one matmul, once ``fuse()`` ran
        self.cpu_kernel = False  # RoPE and the K/V store in one C++ call (``use_cpu_kernels``)
        self.qkv_sizes = (self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim,
                          self.num_kv_heads * self.head_dim)

    def fuse(self) -> None:
        """q, k and v projections merged into ``qkv_proj`` (the HF-named modules are dropped), unless
        their weights are of kinds that do not merge (GGUF blocks of different types)."""
        fused = fuse_linears([self.q_proj, self.k_proj, self.v_proj])
        if fused is not None:
            self.qkv_proj = fused
            del self.q_proj, self.k_proj, self.v_proj

    def _projections(self, x: torch.Tensor):
        """q [..., H, D], k and v [..., H_kv, D], before RoPE."""
        shape = x.shape[:-1]
        if self.qkv_proj is not None:
            q, k, v = self.qkv_proj(x).split(self.qkv_sizes, dim=-1)
        else:
            q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        return (q.reshape(*shape, self.num_heads, self.head_dim), k.reshape(*shape, self.num_kv_heads, self.head_dim),
                v.reshape(*shape, self.num_kv_heads, self.head_dim))

    def _qkv(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        q, k, v = self._projections(x)
        return apply_rope(q, cos, sin), apply_rope(k, cos, sin), v

    def forward_dense(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """x: [B, L, hidden] -> [B, L, hidden], plain causal attention, no cache."""
        b, l, _ = x.shape
        q, k, v = self._qkv(x, cos, sin)
        mask = None
        if self.window is not None and l > self.window:
            pos = torch.arange(l, device=x.device)
            mask = window_mask(pos, pos, self.window)
        out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                             attn_mask=mask, is_causal=mask is None, enable_gqa=self.gqa)
        return self.o_proj(out.transpose(1, 2).reshape(b, l, -1))

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                kv_cache: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """x: [T, hidden] flat new tokens; kv_cache: [2, num_blocks, block_size, H_kv, D]."""
        k_cache, v_cache = kv_cache[0], kv_cache[1]
        if meta.paged is not None:
            q, k, v = self._qkv(x, cos, sin)
            paged_attention.store_kv(k, v, k_cache, v_cache, meta.slot_mapping)
            out = paged_attention.paged_attention(q, k_cache, v_cache, meta.paged, self.scale, self.window)
            return self.o_proj(out.reshape(out.shape[0], -1))
        if (self.cpu_kernel and x.dtype == torch.float32 and kv_cache.dtype == torch.float32
                and not torch.is_grad_enabled()):
            q, k, v = self._projections(x)
            cpu_kernels.loaded().rope_store_kv(q, k, v, cos, sin, k_cache, v_cache, meta.slot_mapping)  # q, k in place
        else:
            q, k, v = self._qkv(x, cos, sin)
            k_cache.view(-1, self.num_kv_heads, self.head_dim).index_copy_(0, meta.slot_mapping, k)
            v_cache.view(-1, self.num_kv_heads, self.head_dim).index_copy_(0, meta.slot_mapping, v)
        if not meta.prefills and meta.decode_index is not None:   # only decodes, in order: no scatter
            return self.o_proj(self._decode(q, kv_cache, meta).reshape(q.shape[0], -1))

        out = torch.empty_like(q)
        bs = k_cache.shape[1]
        for span in meta.prefills:
            n_new = span.end - span.start
            qs = q[span.start:span.end].transpose(0, 1).unsqueeze(0)      # [1, H, n, D]
            first_q = span.context_len - n_new
            if first_q == 0 and (self.window is None or n_new <= self.window):  # no cached prefix
                ks, vs = k[span.start:span.end], v[span.start:span.end]
                mask, causal = None, True
            else:                      # chunk after a cached prefix, or wider than the window
                # keys from the first one the chunk's first query can see (whole blocks), to its end
                first_block = 0 if self.window is None else max(0, first_q - self.window + 1) // bs
                table = span.block_table[first_block:]
                kv = kv_cache.flatten(2).index_select(1, table).view(2, -1, self.num_kv_heads, self.head_dim)
                ks, vs = kv[:, :span.context_len - first_block * bs]
                q_pos = torch.arange(first_q, span.context_len, device=x.device)
                mask = window_mask(q_pos, torch.arange(first_block * bs, span.context_len, device=x.device),
                                   self.window)
                causal = False
            o = F.scaled_dot_product_attention(qs, ks.transpose(0, 1).unsqueeze(0), vs.transpose(0, 1).unsqueeze(0),
                                               attn_mask=mask, is_causal=causal, enable_gqa=self.gqa)
            out[span.start:span.end] = o[0].transpose(0, 1)

        if meta.decode_index is not None:
            out[meta.decode_index] = self._decode(q[meta.decode_index], kv_cache, meta)
        return self.o_proj(out.reshape(out.shape[0], -1))

    def _decode(self, q: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """q: [Bd, H, D], the 1-token decodes' queries -> their attention outputs [Bd, H, D]: by the C++
        kernel reading their blocks in place, or over their blocks gathered (K and V in one gather)
        into a padded batch."""
        bt = meta.decode_block_tables
        if meta.decode_context_lens is not None:
            return cpu_attention.paged_decode(q, kv_cache, bt, meta.decode_context_lens, self.scale, self.window)
        bd = bt.shape[0]
        kv = (kv_cache.flatten(2).index_select(1, bt.view(-1))       # a row copy per block: several times
              .view(2, bd, -1, self.num_kv_heads, self.head_dim).transpose(2, 3))  # faster than kv_cache[:, bt]
        mask = meta.decode_mask if self.window is None else meta.decode_window_mask
        return decode_attention(q.unsqueeze(2), kv[0], kv[1], mask).squeeze(2)


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.gate_proj = Linear(cfg.hidden_size, cfg.intermediate_size, bias=cfg.mlp_bias)
        self.up_proj = Linear(cfg.hidden_size, cfg.intermediate_size, bias=cfg.mlp_bias)
        self.down_proj = Linear(cfg.intermediate_size, cfg.hidden_size, bias=cfg.mlp_bias)

        self.gate_up_proj: Linear | None = None  # gate|up in one matmul, once ``fuse()`` ran

    def fuse(self) -> None:
        fused = fuse_linears([self.gate_proj, self.up_proj])
        if fused is not None:
            self.gate_up_proj = fused
            del self.gate_proj, self.up_proj

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.gate_up_proj is not None:
            gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
            return self.down_proj(F.silu(gate) * up)
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int = 0):
        super().__init__()
        self.self_attn = Attention(cfg, layer)
        self.mlp = MLP(cfg)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class LlamaModel(nn.Module):
    def __init__(self, cfg: ModelConfig, max_positions: int):
        super().__init__()
        self.embed_tokens = Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i) for i in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.rotary = RotaryEmbedding(cfg, max_positions)


class LlamaForCausalLM(nn.Module):
    """The whole causal LM. ``max_positions`` bounds the RoPE table (the engine's max_model_len)."""

    def __init__(self, cfg: ModelConfig, max_positions: int | None = None):
        super().__init__()
        self.config = cfg
        self.model = LlamaModel(cfg, max_positions or cfg.max_position_embeddings)
        self.lm_head = Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                kv_caches: list[torch.Tensor], meta: AttentionMetadata) -> torch.Tensor:
        """Serving path. input_ids/positions: [T] flat -> final hidden states [T, hidden]."""
        h = self.model.embed_tokens(input_ids)
        cos, sin = self.model.rotary(positions, h.dtype)
        residual = None        # the running hidden state; h is each block's output until it is added
        for layer, kv in zip(self.model.layers, kv_caches):
            x, residual = layer.input_layernorm.with_residual(h, residual)
            h = layer.self_attn(x, cos, sin, kv, meta)
            x, residual = layer.post_attention_layernorm.with_residual(h, residual)
            h = layer.mlp(x)
        return self.model.norm.with_residual(h, residual)[0]

    def use_cpu_kernels(self, linear: bool, elementwise: bool, int8_activations: bool = False) -> None:
        """Route the serving path's few-row matmuls (``linear``) and its norms with their residual adds
        and RoPE with the K/V store (``elementwise``) through the C++ CPU kernels (loaded:
        ``cpu_kernels.kernel()``), or back to torch (``EngineConfig.linear`` and ``elementwise``); a
        GGUF's block layers take 8-bit activations in steps of up to 32 rows with ``int8_activations``
        (``EngineConfig.block_activations``). The choice is the model's: engines sharing one model
        object in a process share the last one made."""
        use_cpu_kernel(self, linear)
        for m in self.modules():
            if isinstance(m, (RMSNorm, Attention)):
                m.cpu_kernel = elementwise
            elif isinstance(m, BlockLinear):
                m.int8_activations = int8_activations

    def fuse_projections(self) -> None:
        """Merge each layer's q/k/v and gate/up projections (one matmul each instead of 3 and 2)."""
        for layer in self.model.layers:
            layer.self_attn.fuse()
            layer.mlp.fuse()

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden).float()

    def hidden_dense(self, input_ids: torch.Tensor) -> torch.Tensor:
        """input_ids: [B, L] -> the final (normed) hidden states [B, L, hidden], no cache. Causal, so
        right padding never changes the positions before it."""
        b, l = input_ids.shape
        h = self.model.embed_tokens(input_ids)
        positions = torch.arange(l, device=input_ids.device).expand(b, l)
        cos, sin = self.model.rotary(positions, h.dtype)
        for layer in self.model.layers:
            h = h + layer.self_attn.forward_dense(layer.input_layernorm(h), cos, sin)
            h = h + layer.mlp(layer.post_attention_layernorm(h))
        return self.model.norm(h)

    def forward_dense(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Training/parity path. input_ids: [B, L] -> logits [B, L, vocab] (float32)."""
        return self.compute_logits(self.hidden_dense(input_ids))
