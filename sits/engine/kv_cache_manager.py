"""KVCacheManager: a sequence's KV blocks, and the only code that touches its block table and hashes.

The scheduler decides *who* computes *how many* tokens; this decides whether the blocks for them
exist and keeps the prefix cache current: cached full blocks reused on (re)admission, blocks that
became full published once computed, everything released when a sequence ends or is preempted.
In the manner of nano-vllm's ``BlockManager`` and vLLM v1's ``KVCacheManager``.
"""

from __future__ import annotations

from sits.engine.block_pool import BlockPool
from sits.engine.sequence import Sequence


class KVCacheManager:
    def __init__(self, pool: BlockPool):
        self.pool = pool
        self.block_size = pool.block_size

    @property
    def num_free(self) -> int:
        return self.pool.num_free

    def blocks_needed(self, num_tokens: int) -> int:
        return self.pool.blocks_needed(num_tokens)

    def missing_blocks(self, seq: Sequence, num_tokens: int) -> int:
        """Blocks ``seq`` lacks to hold ``num_tokens`` tokens in all (0 if it has them)."""
        return max(0, self.pool.blocks_needed(num_tokens) - len(seq.block_table))

    def match_prefix(self, seq: Sequence) -> None:
        """On (re)admission, take the cached full blocks of its prefix; at least one token is always
        left to compute (its logits give the next token)."""
        if seq.block_table:
            return
        ids, hashes = self.pool.match_prefix(seq.all_token_ids, seq.num_tokens - 1, seq.cache_root)
        seq.block_table, seq.block_hashes = ids, hashes
        seq.num_computed_tokens = seq.num_cached_tokens = len(ids) * self.block_size

    def allocate(self, seq: Sequence, num_new: int) -> bool:
        """Blocks for ``num_new`` more computed tokens of ``seq``; False (nothing taken) if the pool
        cannot give them."""
        need = self.missing_blocks(seq, seq.num_computed_tokens + num_new)
        if need > self.pool.num_free:
            return False
        if need:
            seq.block_table.extend(self.pool.allocate(need))
        return True

    def record_admission(self, seq: Sequence) -> None:
        """Count the prefix-cache lookup of an admitted sequence (its full blocks, hits and misses)."""
        queried = (seq.num_tokens - 1) // self.block_size * self.block_size
        self.pool.record_lookup(queried, seq.num_cached_tokens)

    def free(self, seq: Sequence) -> None:
        """Give back every block (finish, abort, preemption); the sequence recomputes from zero."""
        if seq.block_table:
            self.pool.release(seq.block_table)
        seq.block_table = []
        seq.block_hashes = []
        seq.num_computed_tokens = 0

    def cache_full_blocks(self, seq: Sequence) -> None:
        """Publish the blocks whose tokens are now all computed, so later requests can reuse them."""
        bs = self.block_size
        full = seq.num_computed_tokens // bs
        if len(seq.block_hashes) >= full:
            return
        tokens = seq.all_token_ids
        while len(seq.block_hashes) < full:
            i = len(seq.block_hashes)
            seq.block_hashes.append(self.pool.register_full(seq.block_table[i], seq.parent_hash,
                                                            tokens[i * bs:(i + 1) * bs]))
