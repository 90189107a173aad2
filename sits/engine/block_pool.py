"""KV BlockPool: the allocator over a KV cache that is allocated once, with hash-chained prefix reuse.

Blocks hold ``block_size`` tokens. A *full* block gets a hash that chains its tokens with its
parent's hash, so two sequences that share a prefix share the blocks of that prefix (ref-counted).
A block whose ref count drops to zero keeps its hash and goes to the free queue: it can be revived by
a later request with the same prefix until it is evicted, least recently freed first.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

import numpy as np
import xxhash

NO_HASH = -1


@dataclass(slots=True)
class Block:
    block_id: int
    ref_count: int = 0
    hash: int = NO_HASH
    token_ids: tuple[int, ...] = ()   # kept to rule out hash collisions


@dataclass(slots=True)
class BlockPoolStats:
    num_blocks: int
    num_free: int
    num_cached_free: int
    usage: float                 # share of blocks held by live sequences
    prefix_queries: int          # tokens looked up in the prefix cache
    prefix_hits: int             # of those, tokens served from it
    hit_rate: float


def chain_hash(parent: int, token_ids: tuple[int, ...] | list[int]) -> int:
    h = xxhash.xxh64()
    h.update(parent.to_bytes(8, "little", signed=True))
    h.update(np.asarray(token_ids, dtype=np.int64).tobytes())
    return h.intdigest() & 0x7FFF_FFFF_FFFF_FFFF


class BlockPool:
    """Ref-counted fixed-size blocks; free cached blocks are evicted LRU."""

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True):
        if num_blocks < 1:
            raise ValueError("the KV pool needs at least one block")
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.free: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_blocks))
        self.cached: dict[int, int] = {}          # hash -> block_id
        self.prefix_queries = 0
        self.prefix_hits = 0

    # -- queries --------------------------------------------------------------------------------
    @property
    def num_blocks(self) -> int:
        return len(self.blocks)

    @property
    def num_free(self) -> int:
        return len(self.free)

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def stats(self) -> BlockPoolStats:
        cached_free = sum(1 for b in self.free if self.blocks[b].hash != NO_HASH)
        q = self.prefix_queries
        return BlockPoolStats(self.num_blocks, self.num_free, cached_free,
                              1.0 - self.num_free / self.num_blocks, q, self.prefix_hits,
                              self.prefix_hits / q if q else 0.0)

    # -- allocation -----------------------------------------------------------------------------
    def match_prefix(self, token_ids: list[int], max_tokens: int, root: int = NO_HASH) -> tuple[list[int], list[int]]:
        """Longest run of cached full blocks covering at most ``max_tokens`` of ``token_ids``, in the
        chain that starts at ``root`` (the base model's, or a LoRA adapter's: its KV differs).

        Returns (block_ids, hashes) and takes a reference on each matched block. The caller
        records the lookup with ``record_lookup`` once it commits to it.
        """
        ids: list[int] = []
        hashes: list[int] = []
        if not self.enable_prefix_caching:
            return ids, hashes
        bs = self.block_size
        parent = root
        n_full = max_tokens // bs
        for i in range(n_full):
            chunk = tuple(token_ids[i * bs:(i + 1) * bs])
            h = chain_hash(parent, chunk)
            bid = self.cached.get(h)
            if bid is None or self.blocks[bid].token_ids != chunk:
                break
            ids.append(bid)
            hashes.append(h)
            parent = h
        for bid in ids:
            self._take(bid)
        return ids, hashes

    def record_lookup(self, queried_tokens: int, hit_tokens: int) -> None:
        self.prefix_queries += queried_tokens
        self.prefix_hits += hit_tokens

    def allocate(self, n: int) -> list[int]:
        """n fresh blocks (ref 1). The caller checks ``num_free`` first; running out raises."""
        if n > len(self.free):
            raise MemoryError(f"KV pool exhausted: want {n} blocks, {len(self.free)} free")
        out = []
        for _ in range(n):
            bid, _ = self.free.popitem(last=False)          # least recently freed
            b = self.blocks[bid]
            if b.hash != NO_HASH:                            # evict its cached prefix
                if self.cached.get(b.hash) == bid:
                    del self.cached[b.hash]
                b.hash, b.token_ids = NO_HASH, ()
            b.ref_count = 1
            out.append(bid)
        return out

    def _take(self, bid: int) -> None:
        b = self.blocks[bid]
        if b.ref_count == 0:
            del self.free[bid]
        b.ref_count += 1

    def register_full(self, bid: int, parent_hash: int, token_ids: list[int]) -> int:
        """Publish a block whose tokens are now all computed; returns its chain hash."""
        chunk = tuple(token_ids)
        h = chain_hash(parent_hash, chunk)
        if self.enable_prefix_caching:
            b = self.blocks[bid]
            b.hash, b.token_ids = h, chunk
            self.cached.setdefault(h, bid)
        return h

    def release(self, block_ids: list[int]) -> None:
        """Drop one reference from each block; the tail is freed first so prefixes live longest."""
        for bid in reversed(block_ids):
            b = self.blocks[bid]
            b.ref_count -= 1
            if b.ref_count < 0:
                raise RuntimeError(f"block {bid} released more often than taken")
            if b.ref_count == 0:
                self.free[bid] = None
