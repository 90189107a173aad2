"""Attention that reads the paged KV cache in place: Triton kernels for the device's serving path.

The reference path (``models/llama.py``) gathers every decoding sequence's blocks into a dense copy
and runs one SDPA call per prefill chunk: on a GPU that is a few dozen launches and a full copy of the
live KV per layer and step. Here one kernel serves the whole step, prefill chunks (with or without a
cached prefix) and one-token decodes alike (the shape of vLLM's "unified" Triton attention, written
anew for this cache layout), and a second stores the step's new K/V into their slots:

- ``store_kv``: one program per new token copies its K and V rows into the slot ``slot_mapping``
  names; a slot of -1 is skipped (the padding rows of a captured decode graph).
- ``paged_attention``: one program per (sequence, block of queries, KV head). Its queries are the
  block's positions × the KV head's group of query heads, so each K/V tile is read once for the
  whole group (grouped-query attention costs no extra reads). It walks the sequence's keys a tile at
  a time through its block table with an online softmax (flash attention), causal against each
  query's absolute position, within the model's sliding window when it has one. Every shape is read
  from tensors (``PagedMetadata``), so a decode step's launch is the same for every step of a batch
  size and a CUDA graph can replay it.

Triton compiles for the GPU it finds; with ``TRITON_INTERPRET=1`` the same kernels run on the CPU
through Triton's interpreter, which is how the test suite checks them on hosts without a GPU. The
interpreter's ``tl.dot`` gives wrong results for bf16 operands (Triton 3.9), so there (and only there)
operands are upcast to fp32 before each dot.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from functools import lru_cache

import torch


@lru_cache(maxsize=None)
def _triton():
    try:
        import triton
        import triton.language as tl
    except ImportError:
        return None
    return triton, tl


def interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"


def available(device: torch.device) -> bool:
    """Can the Triton kernels run on ``device``: a CUDA device with Triton installed, or any device
    under Triton's interpreter."""
    if _triton() is None:
        return False
    return device.type == "cuda" or interpreting()


@dataclass(slots=True)
class PagedMetadata:
    """One step's batch for the kernels, as device tensors (sequences in the flat batch's order)."""

    cu_seqlens_q: torch.Tensor    # [B + 1] int32: offsets of each sequence's new tokens in the flat batch
    seq_lens: torch.Tensor        # [B] int32: tokens in the KV cache after this step (cached + new)
    block_tables: torch.Tensor    # [B, max_blocks] int32 (padding entries are never read past seq_lens)
    max_query_len: int            # the longest run of new tokens (sizes the launch grid)


_kernels: dict[str, object] = {}


def _build() -> dict[str, object]:
    """Define the kernels on first use (importing Triton costs a second; CPU-only serving never does)."""
    if _kernels:
        return _kernels
    triton, tl = _triton()

    @triton.jit
    def store_kv_kernel(k_ptr, v_ptr, k_cache_ptr, v_cache_ptr, slot_ptr, k_stride, v_stride,
                        WIDTH: tl.constexpr, WIDTH_PAD: tl.constexpr):
        token = tl.program_id(0)
        slot = tl.load(slot_ptr + token).to(tl.int64)
        if slot >= 0:
            offs = tl.arange(0, WIDTH_PAD)
            mask = offs < WIDTH
            k = tl.load(k_ptr + token * k_stride + offs, mask=mask)
            v = tl.load(v_ptr + token * v_stride + offs, mask=mask)
            tl.store(k_cache_ptr + slot * WIDTH + offs, k, mask=mask)
            tl.store(v_cache_ptr + slot * WIDTH + offs, v, mask=mask)

    @triton.jit(do_not_specialize=["table_stride"])   # the eager path's width varies per step: one compile
    def attention_kernel(out_ptr, q_ptr, k_cache_ptr, v_cache_ptr, cu_seqlens_ptr, seq_lens_ptr, tables_ptr,
                         scale, q_stride_t, q_stride_h, o_stride_t, o_stride_h, table_stride,
                         cache_stride_block, cache_stride_pos, cache_stride_head,
                         GROUP: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_M: tl.constexpr,
                         HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr, BLOCK_SIZE: tl.constexpr,
                         TILE: tl.constexpr, WINDOW: tl.constexpr, UPCAST: tl.constexpr, IEEE: tl.constexpr):
        seq = tl.program_id(0)
        q_block = tl.program_id(1)
        kv_head = tl.program_id(2)
        q_begin = tl.load(cu_seqlens_ptr + seq)
        q_len = tl.load(cu_seqlens_ptr + seq + 1) - q_begin
        if q_block * BLOCK_Q < q_len:
            seq_len = tl.load(seq_lens_ptr + seq)
            context = seq_len - q_len                       # keys cached before this step's tokens
            rows = tl.arange(0, BLOCK_M)
            q_pos = q_block * BLOCK_Q + rows // GROUP       # position among this step's tokens
            head = kv_head * GROUP + rows % GROUP
            row_ok = (rows < BLOCK_Q * GROUP) & (q_pos < q_len)
            dims = tl.arange(0, HEAD_DIM_PAD)
            dim_ok = dims < HEAD_DIM
            q = tl.load(q_ptr + (q_begin + q_pos)[:, None] * q_stride_t + head[:, None] * q_stride_h + dims[None, :],
                        mask=row_ok[:, None] & dim_ok[None, :], other=0.0)
            if UPCAST:
                q = q.to(tl.float32)
            abs_pos = context + q_pos                       # each query's absolute position
            last_q = tl.minimum(q_block * BLOCK_Q + BLOCK_Q, q_len) - 1
            key_end = context + last_q + 1                  # keys [key_begin, key_end) can be seen
            key_begin = 0
            if WINDOW > 0:
                key_begin = tl.maximum(context + q_block * BLOCK_Q - WINDOW + 1, 0)
            m = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
            l = tl.zeros([BLOCK_M], dtype=tl.float32)
            acc = tl.zeros([BLOCK_M, HEAD_DIM_PAD], dtype=tl.float32)
            cols = tl.arange(0, TILE)
            for tile in range(key_begin // TILE, tl.cdiv(key_end, TILE)):
                k_pos = tile * TILE + cols
                k_ok = k_pos < key_end
                block = tl.load(tables_ptr + seq * table_stride + k_pos // BLOCK_SIZE, mask=k_ok, other=0).to(tl.int64)
                where = (block * cache_stride_block + (k_pos % BLOCK_SIZE) * cache_stride_pos
                         + kv_head * cache_stride_head)
                k = tl.load(k_cache_ptr + where[None, :] + dims[:, None], mask=dim_ok[:, None] & k_ok[None, :],
                            other=0.0)                                                  # [HEAD_DIM_PAD, TILE]
                v = tl.load(v_cache_ptr + where[:, None] + dims[None, :], mask=k_ok[:, None] & dim_ok[None, :],
                            other=0.0)                                                  # [TILE, HEAD_DIM_PAD]
                if UPCAST:
                    k = k.to(tl.float32)
                    v = v.to(tl.float32)
                if IEEE:
                    s = tl.dot(q, k, input_precision="ieee") * scale
                else:
                    s = tl.dot(q, k) * scale
                seen = row_ok[:, None] & k_ok[None, :] & (k_pos[None, :] <= abs_pos[:, None])
                if WINDOW > 0:
                    seen = seen & (abs_pos[:, None] - k_pos[None, :] < WINDOW)
                s = tl.where(seen, s, float("-inf"))
                m_new = tl.maximum(m, tl.max(s, axis=1))
                shift = tl.where(m_new > float("-inf"), m_new, 0.0)     # a row that has seen nothing yet
                p = tl.exp(s - shift[:, None])
                alpha = tl.exp(m - shift)
                l = l * alpha + tl.sum(p, axis=1)
                acc = acc * alpha[:, None]
                if IEEE:
                    acc += tl.dot(p.to(v.dtype), v, input_precision="ieee")
                else:
                    acc += tl.dot(p.to(v.dtype), v)
                m = m_new
            acc = acc / tl.where(l > 0, l, 1.0)[:, None]      # padding rows saw nothing (they are not stored)
            tl.store(out_ptr + (q_begin + q_pos)[:, None] * o_stride_t + head[:, None] * o_stride_h + dims[None, :],
                     acc.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & dim_ok[None, :])

    _kernels.update(store_kv=store_kv_kernel, attention=attention_kernel,
                    interpreted=interpreting())      # decided when the kernels are defined, as Triton does
    return _kernels


def store_kv(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    """k, v: [T, H_kv, D] (each token's heads contiguous); caches: [num_blocks, block_size, H_kv, D]."""
    kernels = _build()
    tokens, heads, dim = k.shape
    assert k.stride(2) == 1 and k.stride(1) == dim and v.stride(2) == 1 and v.stride(1) == dim
    assert k_cache.is_contiguous() and v_cache.is_contiguous()
    width = heads * dim
    if tokens:
        kernels["store_kv"][(tokens,)](k, v, k_cache, v_cache, slot_mapping, k.stride(0), v.stride(0),
                                       WIDTH=width, WIDTH_PAD=_pow2(width))


def _pow2(n: int) -> int:
    """The smallest power of two >= n (Triton's block shapes)."""
    return 1 << (n - 1).bit_length()


def attention_constants(dtype: torch.dtype, heads: int, kv_heads: int, dim: int, block_size: int, max_query_len: int,
                        window: int | None, interpreted: bool = False) -> dict[str, object]:
    """The attention kernel's compile-time constants for a step of this shape: 16 query rows per
    program for decodes (the smallest ``tl.dot``), 64 for prefills; tiles of 64 keys (32 past
    head_dim 128), which may span several KV blocks."""
    group = heads // kv_heads
    block_m = max(16 if max_query_len <= 1 else 64, _pow2(group))
    return dict(GROUP=group, BLOCK_Q=block_m // group, BLOCK_M=block_m, HEAD_DIM=dim,
                HEAD_DIM_PAD=max(16, _pow2(dim)), BLOCK_SIZE=block_size,
                TILE=64 if dim <= 128 else 32, WINDOW=window or 0, UPCAST=interpreted and dtype != torch.float32,
                IEEE=dtype == torch.float32)


def paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: PagedMetadata,
                    scale: float, window: int | None, out: torch.Tensor | None = None) -> torch.Tensor:
    """q: [T, H, D] -> [T, H, D]: each new token attends causally to its sequence's keys in the cache
    (this step's K/V stored already)."""
    kernels = _build()
    tokens, heads, dim = q.shape
    _, block_size, kv_heads, _ = k_cache.shape
    out = torch.empty_like(q) if out is None else out
    seqs = meta.seq_lens.shape[0]
    if not tokens or not seqs:
        return out
    const = attention_constants(q.dtype, heads, kv_heads, dim, block_size, meta.max_query_len, window,
                                interpreted=kernels["interpreted"])
    grid = (seqs, (meta.max_query_len + const["BLOCK_Q"] - 1) // const["BLOCK_Q"], kv_heads)
    kernels["attention"][grid](
        out, q, k_cache, v_cache, meta.cu_seqlens_q, meta.seq_lens, meta.block_tables, scale,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1), meta.block_tables.stride(0),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), **const)
    return out
