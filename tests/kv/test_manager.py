"""KVManager on a tiny pool (11 blocks of 4): exact block ids through allocate (with lookahead),
truncate (rollback), fork (copy-on-write) and free; the pool is full again at the end."""

from dataclasses import dataclass, field

from tokenhaul.kv.block_pool import BlockPool
from tokenhaul.kv.manager import KVManager
from tokenhaul.kv.prefix_cache import PrefixCache


@dataclass
class Seq:
    all_token_ids: list[int]
    block_ids: list[int] = field(default_factory=list)
    block_hashes: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0


def manager(prefix=True):
    pool = BlockPool(11, 4)
    return KVManager(pool, PrefixCache(pool, prefix)), pool


def test_allocate_with_lookahead_then_truncate():
    kv, pool = manager()
    s = Seq(list(range(6)))
    assert kv.match(s) == 0
    assert kv.allocate_slots(s, 6, lookahead=5) == []  # 11 slots → 3 blocks
    assert s.block_ids == [0, 1, 2]
    s.num_computed_tokens = 6
    kv.truncate(s, 7)  # drafts rejected: keep the slots of 7 positions → 2 blocks
    assert s.block_ids == [0, 1] and pool.num_free == 9
    kv.free(s)
    assert pool.num_free == 11 and s.num_computed_tokens == 0


def test_allocate_refuses_without_changing_anything():
    kv, pool = manager()
    s, t = Seq(list(range(40))), Seq(list(range(8)))
    assert kv.allocate_slots(s, 40) == []
    assert kv.allocate_slots(t, 8) is None
    assert t.block_ids == [] and pool.num_free == 1
    kv.free(s)
    assert pool.num_free == 11


def test_fork_shares_blocks_and_copies_on_first_write():
    kv, pool = manager(prefix=False)
    parent = Seq(list(range(6)))
    kv.allocate_slots(parent, 6)
    parent.num_computed_tokens = 6  # blocks [0, 1]; block 1 half full
    child = Seq(list(range(6)))
    kv.fork(parent, child)
    assert child.block_ids == [0, 1] and pool.ref[0] == pool.ref[1] == 2
    copies = kv.allocate_slots(child, 1)  # writes position 6, in shared block 1
    assert copies == [(1, 2)] and child.block_ids == [0, 2] and pool.ref[1] == 1
    assert kv.allocate_slots(parent, 1) == []  # block 1 is the parent's alone again: written in place
    kv.free(parent)
    kv.free(child)
    assert pool.num_free == 11 and pool.ref == [0] * 11


def test_fork_a_prefix_from_a_holder_then_branch():
    """A finished sequence's blocks kept in a KVHolder; a branch forks its first 5 tokens only (block 1
    partly), writes its own token at 5 (copy of block 1) and never sees the holder's later blocks."""
    from tokenhaul.kv.manager import KVHolder

    kv, pool = manager()
    seq = Seq(list(range(10)))
    kv.allocate_slots(seq, 10)
    seq.num_computed_tokens = 10
    kv.commit(seq)  # blocks 0, 1 cached by content
    held = KVHolder(list(range(10)))
    kv.fork(seq, held)
    kv.free(seq)
    assert held.block_ids == [0, 1, 2] and pool.ref[:3] == [1, 1, 1]
    branch = Seq([0, 1, 2, 3, 4, 99])
    kv.fork(held, branch, 5)
    assert branch.block_ids == [0, 1] and branch.num_computed_tokens == 5 and len(branch.block_hashes) == 1
    assert pool.ref[:3] == [2, 2, 1]
    assert kv.allocate_slots(branch, 1) == [(1, 3)] and branch.block_ids == [0, 3]
    kv.free(branch)
    kv.free(held)
    assert pool.num_free == 11 and pool.ref == [0] * 11


def test_commit_caches_only_computed_full_blocks():
    kv, pool = manager()
    s = Seq(list(range(9)))
    kv.allocate_slots(s, 9)
    s.num_computed_tokens = 9
    kv.commit(s)
    assert len(s.block_hashes) == 2 and pool.num_cached == 2
    kv.free(s)
    t = Seq(list(range(9)) + [50])
    assert kv.match(t) == 8 and t.block_ids == [0, 1]
    kv.free(t)
    assert pool.num_free == 11


def test_rewind_into_own_cached_block_copies_it():
    """A request rewound into a full block it registered (beam / tree search roll back past it) gets a
    private copy: the cached block still holds the tokens the prefix cache matches it by."""
    kv, pool = manager()
    s = Seq(list(range(9)))
    kv.allocate_slots(s, 9)
    s.num_computed_tokens = 9
    kv.commit(s)  # blocks 0, 1 cached, held by s alone (ref 1)
    s.num_computed_tokens = 6
    kv.truncate(s, 6)
    s.all_token_ids = list(range(6)) + [70, 71]
    assert kv.allocate_slots(s, 2) == [(1, 3)] and s.block_ids == [0, 3]
    kv.free(s)
    t = Seq(list(range(9)) + [50])
    assert kv.match(t) == 8 and t.block_ids == [0, 1]  # the cached block 1 was never written
    kv.free(t)
    assert pool.num_free == 11
