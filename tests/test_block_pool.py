"""BlockPool: ref counts, prefix-cache lookups and eviction order (no torch, no model).

What a user notices is which cached prefixes survive memory pressure: these tests name
the block that gets evicted in each situation.
"""

from __future__ import annotations

import pytest

from mooncake.blocks import block_keys, model_fingerprint
from mooncake.engine.block_pool import BlockPool

FP = model_fingerprint("block-pool-test")
BS = 4


def keys_for(tokens: list[int]) -> list[bytes]:
    return block_keys(tokens, BS, FP)


def take(pool: BlockPool, keys: list[bytes]) -> list[int]:
    """Allocate one block per key and name it, as a request that computed them would."""
    ids = [b.block_id for b in pool.allocate(len(keys))]
    for bid, key in zip(ids, keys):
        pool.cache(bid, key)
    return ids


def test_fresh_pool_hands_out_blocks_in_order():
    pool = BlockPool(5)
    blocks = pool.allocate(3)
    assert [b.block_id for b in blocks] == [0, 1, 2]
    assert all(b.ref_cnt == 1 and b.key is None for b in blocks)
    assert pool.num_free_blocks == 2 and pool.usage == pytest.approx(0.6)


def test_tail_blocks_are_evicted_before_the_shared_prefix():
    pool = BlockPool(4)
    keys = keys_for(list(range(16)))
    ids = take(pool, keys)
    pool.free(ids)  # tail first
    assert pool.num_free_blocks == 4 and pool.num_cached_blocks == 4

    (first,) = pool.allocate(1)
    assert first.block_id == ids[3]
    assert [b.block_id for b in pool.lookup(keys)] == ids[:3]
    (second,) = pool.allocate(1)
    assert second.block_id == ids[2]
    assert [b.block_id for b in pool.lookup(keys)] == ids[:2]
    assert pool.stats.evicted_blocks == 2


def test_empty_blocks_are_reused_before_cached_ones():
    pool = BlockPool(6)
    cached_keys = keys_for(list(range(8)))
    cached = take(pool, cached_keys)
    scratch = [b.block_id for b in pool.allocate(2)]  # never named (e.g. partial blocks)
    pool.free(cached)
    pool.free(scratch)
    # Two never-used blocks, then the two unnamed ones, and only then a cached one.
    got = [b.block_id for b in pool.allocate(4)]
    assert sorted(got) == sorted([4, 5, *scratch])
    assert [b.block_id for b in pool.lookup(cached_keys)] == cached
    assert pool.stats.evicted_blocks == 0
    (evicted,) = pool.allocate(1)
    assert evicted.block_id == cached[1]


def test_least_recently_freed_cached_block_is_evicted_first():
    pool = BlockPool(3)
    kx, ky, kz = (keys_for([i] * BS)[0] for i in (1, 2, 3))
    x, y, z = (take(pool, [k])[0] for k in (kx, ky, kz))
    pool.free([y])
    pool.free([x])
    pool.free([z])
    # Reusing x (a prefix hit) refreshes it: freed again, it is now the most recent.
    (hit,) = pool.lookup([kx])
    pool.touch([hit])
    pool.free([x])
    order = [pool.allocate(1)[0].block_id for _ in range(3)]
    assert order == [y, z, x]
    assert pool.num_cached_blocks == 0


def test_shared_prefix_blocks_are_ref_counted():
    pool = BlockPool(8)
    a_tokens = list(range(12))
    b_tokens = list(range(8)) + [99, 98, 97, 96]
    a_ids = take(pool, keys_for(a_tokens))

    b_keys = keys_for(b_tokens)
    hits = pool.lookup(b_keys)
    assert [b.block_id for b in hits] == a_ids[:2]
    pool.touch(hits)
    b_own = take(pool, b_keys[2:])
    b_ids = [b.block_id for b in hits] + b_own
    assert [pool.blocks[i].ref_cnt for i in a_ids] == [2, 2, 1]
    assert pool.num_free_blocks == 8 - 4

    pool.free(a_ids)  # the shared prefix stays in use by b
    assert [pool.blocks[i].ref_cnt for i in a_ids] == [1, 1, 0]
    assert pool.num_free_blocks == 8 - 3
    pool.allocate(5)  # everything free, including a's unshared tail block, goes
    assert [b.block_id for b in pool.lookup(keys_for(a_tokens))] == a_ids[:2]

    pool.free(b_ids)
    assert pool.num_free_blocks == 3
    with pytest.raises(RuntimeError, match="freed more times"):
        pool.free(b_ids[:1])


def test_touching_a_cached_free_block_takes_it_out_of_the_free_queue():
    pool = BlockPool(2)
    keys = keys_for(list(range(4)))
    ids = take(pool, keys)
    pool.free(ids)
    assert pool.num_free_blocks == 2
    pool.touch(pool.lookup(keys))
    assert pool.num_free_blocks == 1
    assert pool.allocate(1)[0].block_id != ids[0]
    with pytest.raises(RuntimeError, match="asked for 1 blocks"):
        pool.allocate(1)


def test_a_duplicate_block_stays_unnamed_and_is_reused_first():
    pool = BlockPool(4)
    key = keys_for(list(range(4)))[0]
    (first,) = take(pool, [key])
    (dup,) = take(pool, [key])  # same content computed twice (admitted before the first was named)
    assert pool.blocks[dup].key is None and pool.num_cached_blocks == 1
    pool.free([first])
    pool.free([dup])
    assert pool.allocate(1)[0].block_id == dup  # ahead of even the never-used blocks
    assert [b.block_id for b in pool.lookup([key])] == [first]


def test_lookup_stops_at_the_first_missing_key_and_counts_only_recorded_hits():
    pool = BlockPool(8)
    keys = keys_for(list(range(16)))
    ids = take(pool, keys[:2])
    other = take(pool, keys_for([7] * 4))  # unrelated
    hits = pool.lookup(keys)
    assert [b.block_id for b in hits] == ids
    assert pool.stats.queried_blocks == 0  # a lookup alone (e.g. a retried admission) is not counted
    pool.record_lookup(len(keys), len(hits))
    assert pool.stats.queried_blocks == 4 and pool.stats.hit_blocks == 2
    assert pool.stats.hit_rate == pytest.approx(0.5)
    assert other


def test_disabled_prefix_caching_never_hits():
    pool = BlockPool(4, enable_prefix_caching=False)
    keys = keys_for(list(range(8)))
    ids = take(pool, keys)
    pool.free(ids)
    assert pool.lookup(keys) == [] and pool.num_cached_blocks == 0


def test_reset_prefix_cache_keeps_blocks_in_use():
    pool = BlockPool(4)
    used_keys = keys_for(list(range(4)))
    free_keys = keys_for([5] * 8)
    take(pool, used_keys)
    pool.free(take(pool, free_keys))
    assert pool.reset_prefix_cache() == 2
    assert pool.lookup(free_keys) == []
    assert len(pool.lookup(used_keys)) == 1


def test_pool_needs_a_block():
    with pytest.raises(ValueError, match="num_blocks"):
        BlockPool(0)
