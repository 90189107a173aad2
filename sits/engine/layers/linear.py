"""Linear layers: the reference ``F.linear``, and on CPUs that compute bf16 natively, weights
pre-packed once for oneDNN.

``F.linear`` on a bf16 CPU tensor hands the weight to oneDNN in its plain layout on every call, and
oneDNN re-lays it out each time: a one-token decode step then reads each weight at a fraction of the
memory bandwidth. Packing it once at load (``mkldnn._reorder_linear_weight``, what inductor's
freezing does) gives bit-identical outputs at several times the speed for a few rows (figures in
docs/benchmarks.md). fp32 weights are not packed: packing them changes the rounding.

A matmul of a few rows (a decode step) is a matrix-vector product, and a BLAS may run it on one
thread (MKL does on AMD CPUs) while the others idle and the weights stream at one core's bandwidth.
``split_linears`` makes such matmuls one ``bmm`` over column blocks of the weight, a block per
intra-op thread (as many as divide the weight's rows evenly). Measured on an AMD CPU only: an Intel
CPU's MKL may thread the product itself, which the split should leave level. Each block runs the
BLAS's own kernel, so results are ``F.linear``'s, or a rounding apart where the BLAS picks another
kernel for the narrower block (``F.linear``'s own rows already change in the last bit with the
number of rows in the batch). Serving only: a weight that trains takes ``F.linear``.

Faster still for up to ``FEW_ROWS_MAX`` rows: the C++ kernel of ``cpu_kernels``
(``EngineConfig.linear``: ``cpp``; ``auto`` takes it for fp32 on a CPU where it is built) streams each
weight row once across the threads for all the rows, where a BLAS's matrix-vector product re-reads
the weight per row and the split ``bmm`` reads it in a transposed layout. Its sums run in another
order than the BLAS's: outputs agree to rounding, not bit for bit. Only under ``torch.no_grad`` or
inference mode (it has no backward).
"""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F
from torch import nn

from sits.engine.layers import cpu_kernels
from sits.engine.layers.block_quant import fuse_block_linears


class Linear(nn.Module):
    """``nn.Linear`` without the random init: weights always come from a checkpoint (or the model
    builder's own seeded init), and skipping ``reset_parameters`` keeps meta-device construction from
    importing torch's compiler stack on the cold-start path (seconds). ``pack()`` swaps the weight for
    its oneDNN layout (the plain weight is then dropped)."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False):
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.weight = nn.Parameter(torch.empty(out_features, in_features))
        self.bias = nn.Parameter(torch.empty(out_features)) if bias else None
        self.packed: torch.Tensor | None = None
        self.split = False      # few-row matmuls split across the intra-op threads (``split_linears``)
        self.cpu_kernel = False  # few-row matmuls through the C++ CPU kernel (``use_cpu_kernel``)
        self._blocks: tuple | None = None   # (the weight's data pointer, threads, ways, its blocks)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.packed is not None:
            return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")
        if (self.cpu_kernel and x.numel() <= FEW_ROWS_MAX * self.in_features and x.dtype == torch.float32
                and not torch.is_grad_enabled()):
            return cpu_kernels.loaded().few_rows_linear(x, self.weight, self.bias)
        if (self.split and x.numel() <= SPLIT_MAX_ROWS * self.in_features and x.device.type == "cpu"
                and not (self.weight.requires_grad and torch.is_grad_enabled())):   # serving only
            threads = torch.get_num_threads()
            if threads > 1:
                ways, blocks = self._blocks_for(threads)
                if ways > 1:
                    return split_matmul(x, self.weight, self.bias, ways, blocks)
        return F.linear(x, self.weight, self.bias)

    def _blocks_for(self, threads: int) -> tuple[int, torch.Tensor | None]:
        """How many column blocks to split into for ``threads`` (the most up to ``threads`` that divide
        the rows evenly), and the weight as those blocks, kept (a view, which keeps its storage and so
        its address) while the weight's storage and the thread count stay."""
        w, cached = self.weight, self._blocks
        if cached is None or cached[0] != w.data_ptr() or cached[1] != threads:
            ways = split_ways(self.out_features, threads)
            cached = self._blocks = (w.data_ptr(), threads, ways, weight_blocks(w, ways) if ways > 1 else None)
        return cached[2], cached[3]

    def pack(self) -> None:
        self.packed = torch.ops.mkldnn._reorder_linear_weight(self.weight.detach(), 1)
        self.weight = None

    @property
    def num_weights(self) -> int:
        return self.in_features * self.out_features


def can_pack(dtype: torch.dtype, device: torch.device) -> bool:
    """Pre-packing pays (and keeps outputs bit-identical) for bf16 weights on a CPU that computes bf16."""
    from sits.engine.config import cpu_computes_bf16

    return (device.type == "cpu" and dtype == torch.bfloat16 and torch.backends.mkldnn.is_available()
            and cpu_computes_bf16())


def pack_linears(model: nn.Module) -> int:
    """Pack every ``Linear`` of ``model`` in place (a tied LM head gets its own packed copy; the
    embedding keeps the shared weight); returns how many."""
    packed = 0
    for module in model.modules():
        if isinstance(module, Linear) and module.packed is None and module.weight is not None:
            module.pack()
            packed += 1
    return packed


SPLIT_MAX_ROWS = 128    # above it a BLAS threads the matmul itself (the split measured level at 256)
FEW_ROWS_MAX = 16       # up to it the C++ kernel beats the split ``bmm`` (measured: docs/benchmarks.md)


def split_ways(out_features: int, threads: int) -> int:
    """How many column blocks a split matmul over ``out_features`` rows takes for ``threads``: the most,
    up to ``threads``, that divide the rows evenly (1: no split)."""
    return next((k for k in range(threads, 1, -1) if out_features % k == 0), 1)


def weight_blocks(weight: torch.Tensor, ways: int) -> torch.Tensor:
    """``weight`` [out, in] as ``ways`` blocks of its rows, transposed: [ways, in, out / ways] (a view)."""
    return weight.view(ways, -1, weight.shape[1]).transpose(1, 2)


def split_matmul(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, ways: int,
                 blocks: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` as one ``bmm`` over ``ways`` column blocks of ``weight`` (its
    rows, which must divide evenly; ``blocks``: ``weight_blocks(weight, ways)`` if kept), which
    torch runs in parallel over the blocks."""
    if blocks is None:
        blocks = weight_blocks(weight, ways)
    rows = x if x.dim() == 2 else x.reshape(-1, x.shape[-1])
    rows = rows.expand(ways, -1, -1)
    out = (torch.bmm(rows, blocks) if bias is None
           else torch.baddbmm(bias.view(ways, 1, -1), rows, blocks))
    if x.dim() == 2 and x.shape[0] == 1:
        return out.view(1, weight.shape[0])
    return out.transpose(0, 1).reshape(*x.shape[:-1], weight.shape[0])


def can_split(dtype: torch.dtype, device: torch.device) -> bool:
    """Splitting pays where the BLAS runs a matrix-vector product on one thread: fp32 on a CPU with
    more than one core for intra-op work."""
    return device.type == "cpu" and dtype == torch.float32 and len(os.sched_getaffinity(0)) > 1


def split_linears(model: nn.Module) -> int:
    """Mark every plain ``Linear`` of ``model`` to split its few-row matmuls (``split_matmul``);
    returns how many were marked."""
    marked = 0
    for m in model.modules():
        if isinstance(m, Linear) and m.packed is None and m.weight is not None and m.weight.is_contiguous():
            m.split = True
            marked += 1
    return marked


def fuse_linears(parts: list[nn.Module]) -> nn.Module | None:
    """One ``Linear`` whose output is the parts' outputs side by side (q|k|v, gate|up): one matmul
    instead of several over the same input. The weights are copied (concatenated). GGUF blocks fuse
    into one ``BlockLinear`` when all parts are blocks of one type; a mix of kinds does not fuse (None)."""
    if any(not isinstance(p, Linear) for p in parts):
        return fuse_block_linears(parts)
    weights = [p.weight.detach() for p in parts]
    fused = Linear(weights[0].shape[1], sum(w.shape[0] for w in weights), bias=parts[0].bias is not None)
    fused.weight = nn.Parameter(torch.cat(weights), requires_grad=False)
    if parts[0].bias is not None:
        fused.bias = nn.Parameter(torch.cat([p.bias.detach() for p in parts]), requires_grad=False)
    return fused


def use_cpu_kernel(model: nn.Module, on: bool) -> int:
    """Route the few-row matmuls of every plain fp32 CPU ``Linear`` of ``model`` through the C++
    kernel (loaded: ``cpu_kernels.kernel()``), or back to torch; returns how many take the kernel."""
    count = 0
    for m in model.modules():
        if isinstance(m, Linear):
            w = m.weight
            usable = (m.packed is None and w is not None and w.device.type == "cpu" and w.dtype == torch.float32
                      and w.is_contiguous())
            m.cpu_kernel = on and usable
            count += m.cpu_kernel
    return count
