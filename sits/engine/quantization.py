"""Weight-only int8: every projection's weight as int8 with one scale per output channel.

Quantized at load (symmetric, per output channel: ``w ≈ q * scale``, ``q`` in [-127, 127]), so a
checkpoint needs no preparation and its weights take half the memory of bf16. Activations, the KV
cache, embeddings, norms and the LM head stay in the compute dtype. A step with a few tokens
(decode) multiplies straight from the int8 weight (``torch._weight_int8pack_mm``, which reads half
the bytes); a step with many (prefill) dequantizes the weight for one matmul instead, where that
kernel is slower than the dense one (``sits bench dtype`` measures both).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

QUANTIZATIONS = ("int8",)
_PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "qkv_proj",
                "gate_up_proj")
# Rows of activations up to which the int8 kernel is used; more rows dequantize the weight instead
# (the kernel's cost grows with the rows, a dequantized matmul's hardly: where they cross was
# measured on SmolLM2's shapes, docs/benchmarks.md).
INT8_KERNEL_MAX_ROWS = 32


def quantize_weight_int8(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(q, scale)``: ``q`` int8 [out, in], ``scale`` float32 [out], with ``q * scale ≈ weight``."""
    w = weight.float()
    scale = w.abs().amax(dim=1).clamp(min=1e-12) / 127.0
    q = torch.clamp(torch.round(w / scale[:, None]), -127, 127).to(torch.int8)
    return q, scale


class Int8Linear(nn.Module):
    """A bias-optional linear layer over an int8 weight with per-output-channel scales."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, dtype: torch.dtype):
        super().__init__()
        q, scale = quantize_weight_int8(weight)
        self.register_buffer("qweight", q.contiguous())
        self.register_buffer("scale", scale.to(dtype))
        self.bias = None if bias is None else nn.Parameter(bias.detach().to(dtype), requires_grad=False)
        self.in_features, self.out_features = weight.shape[1], weight.shape[0]
        self._kernel = dtype == torch.bfloat16 or weight.device.type == "cuda"

    def dequantized(self, dtype: torch.dtype) -> torch.Tensor:
        return self.qweight.to(dtype) * self.scale[:, None].to(dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.numel() // x.shape[-1]
        if self._kernel and rows <= INT8_KERNEL_MAX_ROWS:
            out = torch._weight_int8pack_mm(x.reshape(rows, x.shape[-1]), self.qweight, self.scale)
            out = out.view(*x.shape[:-1], self.out_features)
            return out if self.bias is None else out + self.bias
        return F.linear(x, self.dequantized(x.dtype), self.bias)


def quantize_model(model: nn.Module, method: str, dtype: torch.dtype) -> int:
    """Replace every attention and MLP projection of ``model`` in place; returns how many."""
    if method not in QUANTIZATIONS:
        raise ValueError(f"quantization {method!r} is not supported; use one of {QUANTIZATIONS}")
    swapped = 0
    for parent in list(model.modules()):
        for name in _PROJECTIONS:
            child = getattr(parent, name, None)
            if child is not None and not isinstance(child, Int8Linear) and getattr(child, "weight", None) is not None:
                setattr(parent, name, Int8Linear(child.weight.data, getattr(child, "bias", None), dtype))
                swapped += 1
    return swapped


def weight_bytes(model: nn.Module) -> int:
    """Bytes of the model's parameters and buffers (tied weights counted once)."""
    seen: set[int] = set()
    total = 0
    for t in list(model.parameters()) + list(model.buffers()):
        if t.data_ptr() not in seen:
            seen.add(t.data_ptr())
            total += t.numel() * t.element_size()
    packed = (getattr(m, "packed", None) for m in model.modules())     # oneDNN-laid-out linears
    return total + sum(p.numel() * p.element_size() for p in packed if p is not None)
