"""A GGUF's block-quantized weights served as the file holds them, on a CPU.

A decode step reads every weight once, so on a CPU its time is the weights' bytes over the memory
bandwidth. Dequantized at load, a GGUF's Q4_K projections become fp32, 32 bits a value where the file
spends 4.5. Kept as blocks (``BLOCK_TYPES``: the 32-value Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, and the K-quants
Q4_K, Q5_K, Q6_K of 256-value super-blocks that the common Q4_K_M/Q5_K_M files are made of), they are
read as they are and expanded on the fly by the C++ kernels of ``cpu_kernels``:

- up to ``KERNEL_MAX_ROWS`` activation rows (decode): ``block_linear`` expands each 32 values in
  registers and uses them for every row at once (per group ``scale * sum(q x) + min * sum(x)``);
  with ``int8_activations`` (``EngineConfig.block_activations``), up to ``INT8_MAX_ROWS`` rows are
  quantized to 8 bits per block and multiplied with integer dot products, as llama.cpp does: faster
  (no quant is widened to a float), approximate (x keeps 8 bits);
- more rows (prefill): the weight is expanded ``DEQUANT_SLICE_VALUES`` values at a time to fp32, into a
  buffer reused across layers (it stays in the last-level cache), and multiplied by torch's matmul,
  which at many rows is faster than any loop over blocks;
- the token embedding expands only the rows it looks up (a tied LM head shares its blocks).

Expanded values are exactly gguf's own dequantization's; sums run in another order than the BLAS's,
so outputs agree with the dequantized model's to rounding, not bit for bit. fp32 only (the kernels'
dtype), and only without autograd for the kernel path. ``EngineConfig.gguf_weights`` chooses (``auto``:
blocks for an fp32 CPU engine where the kernels are built); other tensor types (F16, BF16, Q2_K, Q3_K,
the IQ types) are dequantized at load as before.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from sits.engine.layers import cpu_kernels

# the tensor types the kernels multiply in place: ggml's type id, the values of a block, its bytes
BLOCK_TYPES = {"Q4_0": (2, 32, 18), "Q4_1": (3, 32, 20), "Q5_0": (6, 32, 22), "Q5_1": (7, 32, 24),
               "Q8_0": (8, 32, 34), "Q4_K": (12, 256, 144), "Q5_K": (13, 256, 176), "Q6_K": (14, 256, 210)}
KERNEL_MAX_ROWS = 32                # above it, expanded slices and torch's matmul (measured: docs/benchmarks.md)
INT8_MAX_ROWS = KERNEL_MAX_ROWS     # the integer kernel's rows (above them a prefill's: fp32 as ever)
DEQUANT_SLICE_VALUES = 1 << 21      # a prefill expands the weight this many values at a time (8 MB of fp32)


@dataclass(frozen=True, slots=True)
class BlockWeight:
    """A weight [out, in] as GGUF blocks: row ``n`` of ``blocks`` holds output row ``n``'s ``in / 32``
    blocks. ``blocks`` may be a read-only view of the file's memory map: never written to."""

    qtype: str                      # a key of BLOCK_TYPES
    blocks: torch.Tensor            # uint8 [out, in / block values * block bytes]
    in_features: int

    def __post_init__(self):
        if self.qtype not in BLOCK_TYPES:
            raise ValueError(f"{self.qtype} blocks are not multiplied in place (only {', '.join(BLOCK_TYPES)})")
        _, values, size = BLOCK_TYPES[self.qtype]
        want = self.in_features // values * size
        if (self.in_features % values or self.blocks.dtype != torch.uint8 or self.blocks.dim() != 2
                or self.blocks.shape[1] != want):
            raise ValueError(f"{self.qtype} blocks of shape {tuple(self.blocks.shape)} do not hold rows of "
                             f"{self.in_features} values")

    @property
    def out_features(self) -> int:
        return self.blocks.shape[0]

    def dequantize(self) -> torch.Tensor:
        return dequantize(self.blocks, self.qtype, self.in_features)


def dequantize(blocks: torch.Tensor, qtype: str, in_features: int) -> torch.Tensor:
    """``blocks`` (rows of ``qtype`` blocks) as an fp32 [rows, in_features] tensor."""
    return cpu_kernels.loaded().block_dequantize(blocks, BLOCK_TYPES[qtype][0], in_features)


class BlockLinear(nn.Module):
    """A linear layer over a ``BlockWeight`` (bias optional, fp32)."""

    def __init__(self, weight: BlockWeight, bias: torch.Tensor | None = None):
        super().__init__()
        self.qtype = weight.qtype
        self.type_id = BLOCK_TYPES[weight.qtype][0]
        self.in_features, self.out_features = weight.in_features, weight.out_features
        self.register_buffer("blocks", weight.blocks)
        self.bias = None if bias is None else nn.Parameter(bias.detach().float(), requires_grad=False)
        self.int8_activations = False   # a step's rows quantized to 8 bits (``block_linear_int8``)

    @property
    def num_weights(self) -> int:
        return self.in_features * self.out_features

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.numel() // self.in_features
        grad = torch.is_grad_enabled()
        if rows <= KERNEL_MAX_ROWS and x.dtype == torch.float32 and not grad:
            kernels = cpu_kernels.loaded()
            int8 = self.int8_activations and rows <= INT8_MAX_ROWS
            multiply = kernels.block_linear_int8 if int8 else kernels.block_linear
            return multiply(x, self.blocks, self.type_id, self.in_features, self.bias)
        step = max(1, DEQUANT_SLICE_VALUES // self.in_features)
        # without autograd the slices are expanded into one reused buffer (autograd keeps the weight)
        scratch = None if grad else _scratch(min(step, self.out_features) * self.in_features)
        if step >= self.out_features:
            return _matmul(x, self.dequantized(0, self.out_features, scratch).to(x.dtype), self.bias, rows)
        out = x.new_empty(*x.shape[:-1], self.out_features)
        for first in range(0, self.out_features, step):
            last = min(first + step, self.out_features)
            bias = None if self.bias is None else self.bias[first:last]
            out[..., first:last] = _matmul(x, self.dequantized(first, last, scratch).to(x.dtype), bias, rows)
        return out

    def dequantized(self, first: int, last: int, out: torch.Tensor | None = None) -> torch.Tensor:
        """Output rows ``[first, last)`` of the weight as fp32 (in the front of ``out`` if given)."""
        return cpu_kernels.loaded().block_dequantize(self.blocks[first:last], self.type_id, self.in_features, out)


_local = threading.local()


def _matmul(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None, rows: int) -> torch.Tensor:
    """``F.linear``, split across the threads for up to ``SPLIT_MAX_ROWS`` rows (``linear.split_matmul``:
    a BLAS may run a matmul of that few rows on one core)."""
    from sits.engine.layers.linear import SPLIT_MAX_ROWS, split_matmul, split_ways

    threads = torch.get_num_threads()
    if rows <= SPLIT_MAX_ROWS and threads > 1 and not torch.is_grad_enabled():
        ways = split_ways(w.shape[0], threads)
        if ways > 1:
            return split_matmul(x, w, bias, ways)
    return F.linear(x, w, bias)


def _scratch(values: int) -> torch.Tensor:
    """This thread's buffer for expanded weight slices, grown to ``values`` fp32 values: reused, its
    pages stay mapped, where a fresh tensor per slice faults in every page of the model per step."""
    buf = getattr(_local, "buf", None)
    if buf is None or buf.numel() < values:
        buf = _local.buf = torch.empty(values, dtype=torch.float32)
    return buf


class BlockEmbedding(nn.Module):
    """Token embeddings over a ``BlockWeight`` [vocab, hidden]: a lookup expands only its rows."""

    def __init__(self, weight: BlockWeight):
        super().__init__()
        self.qtype = weight.qtype
        self.in_features = weight.in_features
        self.register_buffer("blocks", weight.blocks)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        rows = self.blocks.index_select(0, ids.reshape(-1))
        return dequantize(rows, self.qtype, self.in_features).view(*ids.shape, self.in_features)


def fuse_block_linears(parts: list[nn.Module]) -> BlockLinear | None:
    """One ``BlockLinear`` whose outputs are the parts' side by side (their blocks' rows concatenated),
    or None when the parts are not all blocks of one type (a K-quant mix may store v_proj apart)."""
    if not all(isinstance(p, BlockLinear) for p in parts) or len({(p.qtype, p.in_features) for p in parts}) != 1:
        return None
    if len({p.bias is None for p in parts}) != 1:
        return None
    blocks = torch.cat([p.blocks for p in parts])
    bias = None if parts[0].bias is None else torch.cat([p.bias for p in parts])
    fused = BlockLinear(BlockWeight(parts[0].qtype, blocks, parts[0].in_features), bias)
    fused.int8_activations = parts[0].int8_activations
    return fused
