"""PrefixCache: full blocks shared across requests, found by a sha256 chain over the blocks' token ids
(each block's key covers every token before it). A hit also compares the block's tokens, so even a
hash collision can never hand one request the KV of another's different text."""

from __future__ import annotations

import hashlib
from array import array
from collections.abc import Sequence

from tokenhaul.kv.block_pool import BlockPool

ROOT = int.from_bytes(hashlib.sha256(b"tokenhaul prefix cache v1").digest(), "big")  # parent of block 0


def block_hash(parent: int, token_bytes: bytes | memoryview) -> int:
    """sha256(parent's 32-byte key ‖ the block's token ids as uint32) as an int: one block's chained key."""
    return int.from_bytes(hashlib.sha256(parent.to_bytes(32, "big") + token_bytes).digest(), "big")


def chain_hashes(token_ids: Sequence[int], block_size: int, parent: list[int]) -> list[int]:
    """Extend `parent` (keys of the first blocks) with the keys of every further full block."""
    hashes = list(parent)
    prev = hashes[-1] if hashes else ROOT
    first = len(hashes) * block_size
    n = (len(token_ids) - first) // block_size
    if n <= 0:
        return hashes
    raw = memoryview(array("I", token_ids[first:first + n * block_size]).tobytes())
    step = 4 * block_size
    for i in range(n):
        prev = block_hash(prev, raw[i * step:(i + 1) * step])
        hashes.append(prev)
    return hashes


class PrefixCache:
    def __init__(self, pool: BlockPool, enabled: bool = True) -> None:
        self.pool = pool
        self.enabled = enabled
        self.hit_tokens = 0
        self.query_tokens = 0
        # block id → (key, token ids) it was cached under; a stale entry (block evicted, reused) never
        # matches, since the pool then maps the key elsewhere or not at all. At most one per block.
        self._content: dict[int, tuple[int, tuple[int, ...]]] = {}

    def match(self, token_ids: list[int]) -> tuple[list[int], list[int]]:
        """Longest run of cached blocks covering a prefix of token_ids, leaving at least the last
        token to compute. Takes a reference on each hit block. Returns (block ids, their hashes)."""
        self.query_tokens += len(token_ids)
        if not self.enabled:
            return [], []
        bs = self.pool.block_size
        usable = chain_hashes(token_ids[: len(token_ids) - 1], bs, [])
        blocks: list[int] = []
        for i, h in enumerate(usable):
            b = self.pool.lookup(h)
            if b is None or self._content.get(b) != (h, tuple(token_ids[i * bs:(i + 1) * bs])):
                break
            blocks.append(b)
        self.pool.touch(blocks)
        self.hit_tokens += len(blocks) * bs
        return blocks, usable[: len(blocks)]

    def register(self, token_ids: list[int], num_computed: int, block_ids: list[int],
                 hashes: list[int]) -> list[int]:
        """Cache every block that is now full and computed; returns the extended hash chain. Only blocks of
        `token_ids` count: slots computed past them (drafts not kept) hold no token of the request."""
        if not self.enabled:
            return hashes
        bs = self.pool.block_size
        full = min(num_computed, len(token_ids)) // bs
        if full <= len(hashes):
            return hashes
        old = len(hashes)
        hashes = chain_hashes(token_ids[: full * bs], bs, hashes)
        for i in range(old, full):
            b, h = block_ids[i], hashes[i]
            self.pool.cache(b, h)
            if self.pool.lookup(h) == b:  # first writer wins: only the block the pool keeps is recorded
                self._content[b] = (h, tuple(token_ids[i * bs:(i + 1) * bs]))
        return hashes
