"""The KV cache tensors: allocated once at start and touched, so serving never page-faults.

With ``touch="background"`` (a cold start with a request already waiting) the tensors are
allocated as zero pages the kernel has not mapped yet (a large calloc is an anonymous mmap, never
written), and ``touch_some`` faults them in a slice at a time while the engine is idle; a slice is
rewritten in place (multiplied by one), so blocks already holding K/V keep them. The pool must read as
zeros from the start: attention over a padded block table multiplies masked positions' V by a zero
weight, and 0 x NaN (uninitialised memory) would poison the whole row.
"""

from __future__ import annotations

import mmap

import numpy as np
import torch

from sits.engine.config import ModelConfig


def bytes_per_block(cfg: ModelConfig, block_size: int, dtype: torch.dtype) -> int:
    elem = torch.empty((), dtype=dtype).element_size()
    return cfg.num_hidden_layers * 2 * block_size * cfg.num_key_value_heads * cfg.head_dim * elem


class KVCache:
    """One [2, num_blocks, block_size, kv_heads, head_dim] tensor per layer (K and V)."""

    def __init__(self, cfg: ModelConfig, num_blocks: int, block_size: int, device: torch.device,
                 dtype: torch.dtype, touch: str = "eager"):
        self.num_blocks = num_blocks
        self.block_size = block_size
        shape = (2, num_blocks, block_size, cfg.num_key_value_heads, cfg.head_dim)
        if touch == "eager" or device.type != "cpu":
            # empty + fill_ writes every page now; torch.zeros may hand back lazily-zeroed pages.
            self.layers = [torch.empty(shape, dtype=dtype, device=device).fill_(0)
                           for _ in range(cfg.num_hidden_layers)]
            self._pending: list[tuple[int, int]] = []
        else:
            self.layers = [_lazy_zeros(shape, dtype) for _ in range(cfg.num_hidden_layers)]
            self._pending = [(layer, start) for layer in range(len(self.layers))
                             for start in range(0, num_blocks, self.TOUCH_BLOCKS)]
        self.nbytes = sum(t.numel() * t.element_size() for t in self.layers)

    TOUCH_BLOCKS = 64

    @property
    def fully_touched(self) -> bool:
        return not self._pending

    def touch_some(self, max_slices: int = 4) -> bool:
        """Fault in a few untouched slices (call between steps); True while some remain."""
        for _ in range(min(max_slices, len(self._pending))):
            layer, start = self._pending.pop()
            view = self.layers[layer][:, start:start + self.TOUCH_BLOCKS]
            view.mul_(1)      # writes every page, values unchanged (copy_ onto itself is a no-op in ATen)
        return bool(self._pending)


def _lazy_zeros(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A zero CPU tensor whose pages are not touched yet: an anonymous mapping of its own (the kernel's
    zero pages, mapped on first access), whatever the allocator's thresholds (``host_memory`` keeps
    allocations of this size in the heap, where calloc would write every page)."""
    nbytes = int(np.prod(shape)) * torch.empty((), dtype=dtype).element_size()
    if nbytes == 0:
        return torch.zeros(shape, dtype=dtype)
    region = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    return torch.from_numpy(np.frombuffer(region, dtype=np.uint8)).view(dtype).view(shape)
