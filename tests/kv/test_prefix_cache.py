"""Prefix-cache keys: a sha256 chain over blocks, and the tokens compared on a hit — so a colliding
key (forced here) never serves one request's KV to another with different tokens."""

from __future__ import annotations

import hashlib
import struct

from drive import run_requests

from tokenhaul.kv import prefix_cache
from tokenhaul.kv.block_pool import BlockPool
from tokenhaul.kv.prefix_cache import PrefixCache, chain_hashes
from tokenhaul.sampling_params import SamplingParams


def test_keys_are_a_sha256_chain():
    """Computed independently: key_i = sha256(key_{i-1} as 32 bytes ‖ block i's ids as uint32 LE)."""
    toks = [5, 70000, 3, 9, 262143, 0, 1, 2]
    prev = hashlib.sha256(b"tokenhaul prefix cache v1").digest()
    want = []
    for i in range(0, 8, 4):
        prev = hashlib.sha256(prev + struct.pack("<4I", *toks[i:i + 4])).digest()
        want.append(int.from_bytes(prev, "big"))
    assert chain_hashes(toks, 4, []) == want
    assert chain_hashes(toks, 4, want[:1]) == want  # extending a chain continues it


def test_a_colliding_key_is_refused_on_its_tokens(monkeypatch):
    monkeypatch.setattr(prefix_cache, "block_hash", lambda parent, ids: parent + 1)  # every block i collides
    pool = BlockPool(8, 4)
    pc = PrefixCache(pool)
    a = [1, 2, 3, 4, 5, 6, 7, 8, 9]
    ids = pool.allocate(3)
    pc.register(a, 9, ids, [])
    pool.free(ids)
    assert pc.match([1, 2, 3, 4, 50, 60, 70, 80, 9])[0] == ids[:1]  # block 0 equal, block 1 differs
    pool.free(ids[:1])
    assert pc.match([9, 9, 9, 9, 5, 6, 7, 8, 9])[0] == []  # same keys as `a`, other tokens: no hit
    assert pc.match(a)[0] == ids[:2]  # the true owner still hits


def test_forced_collisions_never_change_outputs(tiny_core, monkeypatch):
    """With every key colliding, requests of different prompts get the tokens they get with the
    prefix cache off (before the fix they would read each other's KV)."""
    ps = [[7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17], [30, 31, 32, 33, 34, 35, 36, 37, 38, 39, 40],
          [7, 8, 9, 10, 50, 51, 52, 53, 54, 55, 56]]
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    want = [run_requests(tiny_core(enable_prefix_caching=False), [p], params)[0] for p in ps]
    monkeypatch.setattr(prefix_cache, "block_hash", lambda parent, ids: parent + 1)
    core = tiny_core()
    got = [run_requests(core, [p], params)[0] for p in ps]  # one after another: each sees the last's blocks
    assert got == want
    assert core.prefix_cache.hit_tokens == 4  # the third shares its first block with the first: a true hit


def test_register_caches_only_blocks_of_the_tokens_given():
    """num_computed past the tokens (KV written for drafts the request did not keep) registers only the full
    blocks of the tokens themselves: was an IndexError, and no block may be cached under tokens it lacks."""
    pool = BlockPool(8, 4)
    pc = PrefixCache(pool)
    toks = [1, 2, 3, 4, 5, 6]
    ids = pool.allocate(3)
    assert pc.register(toks, 11, ids, []) == chain_hashes(toks, 4, [])  # one full block, not two
    pool.free(ids)
    assert pc.match([1, 2, 3, 4, 5, 6, 7, 8, 9])[0] == ids[:1]
