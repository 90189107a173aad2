"""The KV cache tensors: allocated once at start and touched, so serving never page-faults."""

from __future__ import annotations

import torch

from sits.engine.config import ModelConfig


def bytes_per_block(cfg: ModelConfig, block_size: int, dtype: torch.dtype) -> int:
    elem = torch.empty((), dtype=dtype).element_size()
    return cfg.num_hidden_layers * 2 * block_size * cfg.num_key_value_heads * cfg.head_dim * elem


class KVCache:
    """One [2, num_blocks, block_size, kv_heads, head_dim] tensor per layer (K and V)."""

    def __init__(self, cfg: ModelConfig, num_blocks: int, block_size: int, device: torch.device,
                 dtype: torch.dtype):
        self.num_blocks = num_blocks
        self.block_size = block_size
        shape = (2, num_blocks, block_size, cfg.num_key_value_heads, cfg.head_dim)
        # empty + fill_ writes every page now; torch.zeros may hand back lazily-zeroed pages.
        self.layers = [torch.empty(shape, dtype=dtype, device=device).fill_(0) for _ in range(cfg.num_hidden_layers)]
        self.nbytes = sum(t.numel() * t.element_size() for t in self.layers)
