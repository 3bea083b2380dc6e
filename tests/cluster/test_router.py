"""Router: prefix affinity, load cap, least-loaded spread, replicas going down and up."""

import pytest

from tokenhaul.cluster.router import NoReplica, Router
from tokenhaul.errors import TokenhaulError

BS = 4


def prompt(prefix: int, n_blocks: int = 4, tail: int = 0) -> list[int]:
    """n_blocks full blocks shared by every prompt of the same `prefix`, then a distinct tail."""
    return [prefix * 1000 + i for i in range(n_blocks * BS)] + [7000 + tail, 7001]


def test_shared_prefix_sticks_and_distinct_prefixes_spread():
    r = Router(["a", "b"], BS, load_cap=100)
    first = r.route(prompt(1))
    assert [r.route(prompt(1, tail=i)) for i in range(5)] == [first] * 5
    other = r.route(prompt(2))  # unseen prefix: least loaded, which is the other replica
    assert other != first
    assert r.route(prompt(2, tail=9)) == other
    assert (r.counts.affinity, r.counts.unmatched, r.counts.spilled) == (6, 2, 0)


def test_load_cap_spills_a_hot_prefix_which_stays_home_under_the_cap():
    r = Router(["a", "b"], BS, load_cap=2)
    names = [r.route(prompt(1, tail=i)) for i in range(3)]
    assert names == ["a", "a", "b"]  # a has 2 in flight, b 0: 2 < 0 + 2 is false → spill to b
    assert r.counts.spilled == 1
    assert r.route(prompt(1, tail=3)) == "a"  # a is its home and under the cap again (2 < 1 + 2)
    assert r.route(prompt(1, tail=4)) == "b"  # 3 < 1 + 2 is false: spilled again
    assert (r.load["a"], r.load["b"], r.counts.spilled) == (3, 2, 2)
    for _ in range(3):
        r.finish("a")
    assert r.route(prompt(1, tail=5)) == "a"


def test_prefix_sent_to_a_second_replica_counts_as_computed_twice():
    rr = Router(["a", "b"], BS, policy="round_robin")
    assert [rr.route(prompt(1, tail=i)) for i in range(3)] == ["a", "b", "a"]
    assert rr.counts.duplicate_tokens == 4 * BS  # b was sent the 4 blocks a had: once; a again: none
    rr.route(prompt(1, n_blocks=6, tail=9))  # to b: blocks 1-4 it holds, 5-6 nobody was sent
    assert rr.counts.duplicate_tokens == 4 * BS
    ca = Router(["a", "b"], BS, load_cap=100)
    assert {ca.route(prompt(1, tail=i)) for i in range(3)} == {"a"}
    assert ca.counts.duplicate_tokens == 0


def test_longest_match_wins():
    r = Router(["a", "b"], BS, load_cap=1)
    assert r.route(prompt(1, n_blocks=1)) == "a"  # a was sent block 1
    assert r.route(prompt(1, n_blocks=3)) == "b"  # a is at the cap: spilled; b was sent blocks 1-3
    r.finish("a")
    r.finish("b")
    # block 1 is on both, blocks 2-3 only on b: equal loads, the deeper match decides
    assert r.route(prompt(1, n_blocks=3, tail=5)) == "b"
    assert r.route(prompt(1, n_blocks=1, tail=5)) == "a"  # only block 1: both hold it, a is less loaded


def test_short_prompts_and_least_loaded_policy_spread():
    r = Router(["a", "b", "c"], BS, policy="least_loaded")
    names = [r.route(prompt(1)) for _ in range(6)]
    assert sorted(names) == ["a", "a", "b", "b", "c", "c"]
    r2 = Router(["a", "b"], BS)
    assert {r2.route([1, 2]), r2.route([1, 2])} == {"a", "b"}  # no full block: least loaded


def test_round_robin_ignores_prefixes():
    r = Router(["a", "b"], BS, policy="round_robin")
    assert [r.route(prompt(1)) for _ in range(4)] == ["a", "b", "a", "b"]
    assert r.counts.round_robin == 4 and r.counts.affinity == 0


def test_down_replica_is_avoided_and_forgotten():
    r = Router(["a", "b"], BS, load_cap=100)
    assert r.route(prompt(1)) == "a"
    r.set_up("a", False)
    assert r.route(prompt(1)) == "b"
    r.set_up("a", True)
    r.finish("b")
    r.finish("a")
    # a restarted with an empty cache, so b (which was sent the prefix after) is the owner now
    assert [r.route(prompt(1, tail=i)) for i in range(3)] == ["b"] * 3
    r.set_up("a", False)
    r.set_up("b", False)
    with pytest.raises(NoReplica, match="no engine replica is up"):
        r.route(prompt(1))


def test_lru_bound_and_bad_policy():
    r = Router(["a", "b"], BS, load_cap=100, max_entries=8)
    for p in range(10):
        r.route(prompt(p))
    assert len(r._owners) == 8
    with pytest.raises(TokenhaulError, match="unknown routing policy"):
        Router(["a"], BS, policy="random")
