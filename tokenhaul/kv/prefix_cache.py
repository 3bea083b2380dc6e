"""PrefixCache: hash-chained full blocks (hash of parent hash + token ids) shared across requests."""

from __future__ import annotations

from tokenhaul.kv.block_pool import BlockPool


def chain_hashes(token_ids: list[int], block_size: int, parent: list[int]) -> list[int]:
    """Extend `parent` (hashes of the first blocks) with the hashes of every further full block."""
    hashes = list(parent)
    prev = hashes[-1] if hashes else 0
    for start in range(len(hashes) * block_size, len(token_ids) - block_size + 1, block_size):
        prev = hash((prev, tuple(token_ids[start:start + block_size])))
        hashes.append(prev)
    return hashes


class PrefixCache:
    def __init__(self, pool: BlockPool, enabled: bool = True) -> None:
        self.pool = pool
        self.enabled = enabled
        self.hit_tokens = 0
        self.query_tokens = 0

    def match(self, token_ids: list[int]) -> tuple[list[int], list[int]]:
        """Longest run of cached blocks covering a prefix of token_ids, leaving at least the last
        token to compute. Takes a reference on each hit block. Returns (block ids, their hashes)."""
        self.query_tokens += len(token_ids)
        if not self.enabled:
            return [], []
        bs = self.pool.block_size
        usable = chain_hashes(token_ids[: len(token_ids) - 1], bs, [])
        blocks: list[int] = []
        for h in usable:
            b = self.pool.lookup(h)
            if b is None:
                break
            blocks.append(b)
        self.pool.touch(blocks)
        self.hit_tokens += len(blocks) * bs
        return blocks, usable[: len(blocks)]

    def register(self, token_ids: list[int], num_computed: int, block_ids: list[int],
                 hashes: list[int]) -> list[int]:
        """Cache every block that is now full and computed; returns the extended hash chain."""
        if not self.enabled:
            return hashes
        bs = self.pool.block_size
        full = num_computed // bs
        if full <= len(hashes):
            return hashes
        old = len(hashes)
        hashes = chain_hashes(token_ids[: full * bs], bs, hashes)
        for i in range(old, full):
            self.pool.cache(block_ids[i], hashes[i])
        return hashes
