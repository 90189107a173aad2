"""BlockPool: ref counting, hash-chained prefix reuse, LRU eviction of free cached blocks."""

from __future__ import annotations

import pytest

from sits.engine.block_pool import NO_HASH, BlockPool, chain_hash


def _fill(pool: BlockPool, tokens: list[int]) -> tuple[list[int], list[int]]:
    """Allocate blocks for ``tokens`` and publish every full block, as the scheduler does."""
    ids = pool.allocate(pool.blocks_needed(len(tokens)))
    hashes, parent = [], NO_HASH
    for i in range(len(tokens) // pool.block_size):
        parent = pool.register_full(ids[i], parent, tokens[i * pool.block_size:(i + 1) * pool.block_size])
        hashes.append(parent)
    return ids, hashes


def test_identical_prefixes_share_blocks_and_count_refs():
    pool = BlockPool(8, 4)
    a, _ = _fill(pool, list(range(10)))                       # 2 full blocks + 1 partial
    ids, hashes = pool.match_prefix(list(range(10)) + [99], max_tokens=10)
    assert ids == a[:2] and len(hashes) == 2
    assert [pool.blocks[b].ref_count for b in ids] == [2, 2]
    pool.release(a)
    assert [pool.blocks[b].ref_count for b in ids] == [1, 1]
    assert pool.num_free == 8 - 2
    pool.release(ids)
    assert pool.num_free == 8


def test_hash_chains_on_the_parent():
    pool = BlockPool(8, 4)
    _fill(pool, [1, 2, 3, 4, 5, 6, 7, 8])
    ids, _ = pool.match_prefix([9, 9, 9, 9, 5, 6, 7, 8], max_tokens=8)   # same 2nd block, other parent
    assert ids == []
    assert chain_hash(1, [5, 6, 7, 8]) != chain_hash(2, [5, 6, 7, 8])


def test_freed_cached_blocks_revive_until_evicted_lru():
    pool = BlockPool(4, 2)
    a, _ = _fill(pool, [1, 2, 3, 4])
    pool.release(a)
    assert pool.stats().num_cached_free == 2
    ids, _ = pool.match_prefix([1, 2, 3, 4, 5], max_tokens=4)        # revived from the free queue
    assert ids == a and pool.num_free == 2
    pool.release(ids)
    pool.allocate(3)                     # 2 never-used blocks, then the LRU cached one (a's tail)
    assert pool.match_prefix([1, 2, 3, 4, 5], max_tokens=4)[0] == [a[0]]   # the head survived
    assert pool.num_free == 0


def test_tail_blocks_are_evicted_before_the_prefix_head():
    pool = BlockPool(3, 2)
    a, _ = _fill(pool, [1, 2, 3, 4, 5, 6])
    pool.release(a)
    pool.allocate(1)                                                   # takes the tail block first
    ids, _ = pool.match_prefix([1, 2, 3, 4, 5, 6, 7], max_tokens=6)
    assert ids == a[:2]


def test_prefix_caching_off_never_matches():
    pool = BlockPool(4, 2, enable_prefix_caching=False)
    a, _ = _fill(pool, [1, 2, 3, 4])
    pool.release(a)
    assert pool.match_prefix([1, 2, 3, 4, 5], max_tokens=4) == ([], [])


def test_exhaustion_and_double_free_are_errors():
    pool = BlockPool(2, 2)
    ids = pool.allocate(2)
    with pytest.raises(MemoryError):
        pool.allocate(1)
    pool.release(ids)
    with pytest.raises(RuntimeError):
        pool.release(ids)


def test_stats_hit_rate():
    pool = BlockPool(8, 4)
    pool.record_lookup(16, 8)
    s = pool.stats()
    assert s.prefix_queries == 16 and s.prefix_hits == 8 and s.hit_rate == 0.5 and s.usage == 0.0


def test_background_touched_kv_pool_reads_as_zeros():
    """An urgent instance's pool is not faulted in yet, but must read as zeros: attention weights
    masked positions by 0, and 0 x NaN from uninitialised memory would poison a whole batch row
    (seen as a sampled token id == vocab_size under concurrent decode)."""
    import torch

    from sits.engine.config import ModelConfig
    from sits.engine.host_memory import keep_step_buffers_in_heap
    from sits.engine.kv_cache import KVCache

    keep_step_buffers_in_heap()     # as in every CPU engine: 64 MiB would otherwise come from the heap
    cfg = ModelConfig(architecture="LlamaForCausalLM", vocab_size=64, hidden_size=32, intermediate_size=64,
                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                      max_position_embeddings=64)
    junk = [torch.full((1 << 20,), float("nan")) for _ in range(8)]     # freed memory full of NaN
    del junk
    kv = KVCache(cfg, num_blocks=16384, block_size=16, device=torch.device("cpu"), dtype=torch.float32,
                 touch="background")       # 64 MiB: a fresh mapping, not recycled heap
    assert not kv.fully_touched
    assert all(bool((layer == 0).all()) for layer in kv.layers)
    def rss_mb():
        return int(open("/proc/self/statm").read().split()[1]) * 4096 / 2**20

    kv.layers[0][0, 3].fill_(1.5)
    before = rss_mb()
    while kv.touch_some():
        pass
    assert bool((kv.layers[0][0, 3] == 1.5).all()) and kv.fully_touched     # touching keeps contents
    assert rss_mb() - before > 0.8 * kv.nbytes / 2**20                      # and really faults the pages in
