"""BlockPool: fixed-size KV blocks by integer id — ref counts, a free list, cached blocks kept for
reuse (LRU-evicted only when free blocks run out). Pure integers: never imports torch."""

from __future__ import annotations

from collections import OrderedDict, deque


class OutOfBlocks(Exception):
    """Raised by allocate() when fewer blocks are free than asked for; nothing is allocated then."""


class BlockPool:
    def __init__(self, num_blocks: int, block_size: int) -> None:
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.ref = [0] * num_blocks
        self._free: deque[int] = deque(range(num_blocks))  # never cached, or evicted
        self._evictable: OrderedDict[int, None] = OrderedDict()  # ref 0 but cached; LRU first
        self._hash_of: dict[int, int] = {}  # block id → content hash (cached blocks)
        self._by_hash: dict[int, int] = {}  # content hash → block id
        self.evictions = 0

    # gauges ------------------------------------------------------------------------------
    @property
    def num_free(self) -> int:
        """Blocks allocatable now (truly free plus evictable cached blocks)."""
        return len(self._free) + len(self._evictable)

    @property
    def num_used(self) -> int:
        return self.num_blocks - self.num_free

    @property
    def num_cached(self) -> int:
        return len(self._hash_of)

    # allocation --------------------------------------------------------------------------
    def allocate(self, n: int) -> list[int]:
        """Take n blocks (ref 1 each): free ones first, then evict least recently used cached ones."""
        if n > self.num_free:
            raise OutOfBlocks(f"need {n} blocks, {self.num_free} free")
        out = []
        for _ in range(n):
            if self._free:
                b = self._free.popleft()
            else:
                b, _ = self._evictable.popitem(last=False)
                del self._by_hash[self._hash_of.pop(b)]
                self.evictions += 1
            self.ref[b] = 1
            out.append(b)
        return out

    def touch(self, blocks: list[int]) -> None:
        """Take one more reference on each block (a prefix-cache hit); revives evictable ones."""
        for b in blocks:
            if self.ref[b] == 0:
                self._evictable.pop(b)
            self.ref[b] += 1

    def free(self, blocks: list[int]) -> None:
        """Drop one reference each. At zero a cached block becomes evictable, others return to the
        free list. Tail blocks are released first so they are evicted before the shared head."""
        for b in reversed(blocks):
            assert self.ref[b] > 0, f"double free of block {b}"
            self.ref[b] -= 1
            if self.ref[b] == 0:
                if b in self._hash_of:
                    self._evictable[b] = None
                else:
                    self._free.append(b)

    def is_shared(self, block: int) -> bool:
        """Another holder may read it: more than one reference, or its content is in the prefix cache."""
        return self.ref[block] > 1 or block in self._hash_of

    def copy_on_write(self, block: int) -> int:
        """Return a block safe to write: `block` itself if unshared, else a fresh copy target (the
        caller copies the data and uses the returned id; one reference on `block` is dropped)."""
        if not self.is_shared(block):
            return block
        (new,) = self.allocate(1)
        self.free([block])
        return new

    # content cache -----------------------------------------------------------------------
    def cache(self, block: int, block_hash: int) -> None:
        """Mark a full, computed block as holding the content `block_hash` (first writer wins)."""
        if block_hash not in self._by_hash and block not in self._hash_of:
            self._by_hash[block_hash] = block
            self._hash_of[block] = block_hash

    def lookup(self, block_hash: int) -> int | None:
        return self._by_hash.get(block_hash)
