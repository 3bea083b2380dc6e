import pytest

from tokenhaul.kv.block_pool import BlockPool, OutOfBlocks
from tokenhaul.kv.prefix_cache import PrefixCache, chain_hashes


def test_allocate_free_exact_ids():
    pool = BlockPool(11, 16)
    assert pool.allocate(3) == [0, 1, 2]
    assert pool.num_free == 8 and pool.num_used == 3
    pool.free([0, 1, 2])
    assert pool.num_free == 11
    assert pool.allocate(2) == [3, 4]  # FIFO free list


def test_out_of_blocks_allocates_nothing():
    pool = BlockPool(4, 16)
    pool.allocate(3)
    with pytest.raises(OutOfBlocks):
        pool.allocate(2)
    assert pool.num_free == 1


def test_double_free_is_caught():
    pool = BlockPool(4, 16)
    (b,) = pool.allocate(1)
    pool.free([b])
    with pytest.raises(AssertionError):
        pool.free([b])


def test_cached_blocks_are_evicted_lru_only_when_needed():
    pool = BlockPool(3, 2)
    a, b, c = pool.allocate(3)
    pool.cache(a, 111)
    pool.cache(b, 222)
    pool.free([a, b, c])  # c uncached → free list; a, b evictable (tail first: b then a)
    assert pool.num_cached == 2 and pool.num_free == 3
    assert pool.allocate(1) == [c]  # truly free first
    assert pool.lookup(111) == a and pool.lookup(222) == b
    assert pool.allocate(1) == [b]  # b was released first → least recently used
    assert pool.lookup(222) is None and pool.evictions == 1


def test_touch_revives_cached_block():
    pool = BlockPool(2, 2)
    a, b = pool.allocate(2)
    pool.cache(a, 7)
    pool.free([a, b])
    pool.touch([a])
    assert pool.ref[a] == 1
    assert pool.allocate(1) == [b]
    with pytest.raises(OutOfBlocks):
        pool.allocate(1)


def test_copy_on_write():
    pool = BlockPool(4, 2)
    (a,) = pool.allocate(1)
    assert pool.copy_on_write(a) == a  # unshared: write in place
    pool.touch([a])  # now shared by two sequences
    new = pool.copy_on_write(a)
    assert new != a and pool.ref[a] == 1 and pool.ref[new] == 1


def test_prefix_cache_match_and_register():
    pool = BlockPool(8, 4)
    pc = PrefixCache(pool)
    toks = list(range(10))  # 2 full blocks + 2
    blocks, hashes = pc.match(toks)
    assert blocks == [] and pc.hit_tokens == 0
    ids = pool.allocate(3)
    hashes = pc.register(toks, 10, ids, [])
    assert len(hashes) == 2 and hashes == chain_hashes(toks, 4, [])
    pool.free(ids)
    blocks, _ = pc.match(toks + [99])
    assert blocks == ids[:2] and pc.hit_tokens == 8
    # the last prompt token is always computed: an exact 8-token prompt reuses only 1 block
    pool.free(blocks)
    blocks, _ = pc.match(toks[:8])
    assert blocks == ids[:1]


def test_prefix_cache_chain_depends_on_parent():
    assert chain_hashes([1, 2, 3, 4], 2, [])[1] != chain_hashes([9, 9, 3, 4], 2, [])[1]


def test_prefix_cache_disabled():
    pool = BlockPool(8, 4)
    pc = PrefixCache(pool, enabled=False)
    ids = pool.allocate(2)
    assert pc.register(list(range(8)), 8, ids, []) == []
    assert pc.match(list(range(9))) == ([], [])
