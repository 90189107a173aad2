"""Linear layers: the reference ``F.linear``, and on CPUs that compute bf16 natively, weights
pre-packed once for oneDNN.

``F.linear`` on a bf16 CPU tensor hands the weight to oneDNN in its plain layout on every call, and
oneDNN re-lays it out each time: a one-token decode step then reads each weight at a fraction of the
memory bandwidth. Packing it once at load (``mkldnn._reorder_linear_weight``, what inductor's
freezing does) gives bit-identical outputs at several times the speed for a few rows (figures in
docs/benchmarks.md). fp32 weights stay on ``F.linear``: packing them changes the rounding.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


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

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.packed is not None:
            return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")
        return F.linear(x, self.weight, self.bias)

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


def fuse_linears(parts: list[nn.Module]) -> Linear:
    """One ``Linear`` whose output is the parts' outputs side by side (q|k|v, gate|up): one matmul
    instead of several over the same input. The weights are copied (concatenated)."""
    weights = [p.weight.detach() for p in parts]
    fused = Linear(weights[0].shape[1], sum(w.shape[0] for w in weights), bias=parts[0].bias is not None)
    fused.weight = nn.Parameter(torch.cat(weights), requires_grad=False)
    if parts[0].bias is not None:
        fused.bias = nn.Parameter(torch.cat([p.bias.detach() for p in parts]), requires_grad=False)
    return fused
