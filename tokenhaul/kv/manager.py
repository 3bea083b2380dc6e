"""KVManager: the scheduler's only door to KV blocks — match a cached prefix, allocate slots (with
lookahead for draft tokens), free, fork (copy-on-write) and truncate (roll back rejected positions).

Integers only, never torch: it edits a request's `block_ids` / `block_hashes` / `num_computed_tokens`
and the pool's ref counts. Block data copies it decides on are returned for the runner to make.
Invariant: a request holds exactly the blocks covering its first `len(block_ids) * block_size`
slots; blocks shared with another request (fork) or the prefix cache are never written in place.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

from tokenhaul.kv.block_pool import BlockPool
from tokenhaul.kv.prefix_cache import PrefixCache


class KVOwner(Protocol):
    """What the manager reads and writes on a request (engine/request.py's Request)."""

    block_ids: list[int]
    block_hashes: list[int]
    num_computed_tokens: int

    @property
    def all_token_ids(self) -> list[int]: ...


@dataclass
class KVHolder:
    """Blocks held outside any running request: a beam's fork in transit, a finished tree-search rollout
    kept so its branches can fork from it. `token_ids`: the tokens whose KV the blocks hold."""

    token_ids: list[int] = field(default_factory=list)
    block_ids: list[int] = field(default_factory=list)
    block_hashes: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0

    @property
    def all_token_ids(self) -> list[int]:
        return self.token_ids


class KVManager:
    def __init__(self, pool: BlockPool, prefix_cache: PrefixCache) -> None:
        self.pool = pool
        self.prefix_cache = prefix_cache
        self.block_size = pool.block_size

    @property
    def num_blocks(self) -> int:
        return self.pool.num_blocks

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def blocks_for_beams(self, num_prompt_tokens: int, num_tokens: int, width: int) -> int:
        """Blocks a beam search group may hold at once: its full prompt blocks shared, the rest of `num_tokens`
        (prompt + generated) private to each of `width` beams."""
        shared = num_prompt_tokens // self.block_size
        return shared + width * (self.blocks_for(num_tokens) - shared)

    def match(self, req: KVOwner, uncached: bool = False) -> int:
        """Give a request without blocks the longest cached prefix of its tokens (a reference on each
        hit block); sets `num_computed_tokens` to the tokens covered and returns it. uncached: no cached
        prefix, every token is computed (a request that needs the logits of every prompt position)."""
        if not req.block_ids and not uncached:
            req.block_ids, req.block_hashes = self.prefix_cache.match(req.all_token_ids)
            req.num_computed_tokens = len(req.block_ids) * self.block_size
        return req.num_computed_tokens

    def allocate_slots(self, req: KVOwner, num_new: int, lookahead: int = 0) -> list[tuple[int, int]] | None:
        """Make slots [0, computed + num_new + lookahead) writable for `req`: new blocks at the tail and
        a private copy of any shared block (held twice, or in the prefix cache: a request rewound into
        its own cached block must not overwrite what the cache promises) among those written from
        `computed` on. Returns the
        (src, dst) block copies the runner must make first, or None — changing nothing — when the
        pool is short (the caller preempts or waits)."""
        bs = self.block_size
        end = req.num_computed_tokens + num_new + lookahead
        first = req.num_computed_tokens // bs
        shared = [i for i in range(first, min(len(req.block_ids), self.blocks_for(end)))
                  if self.pool.is_shared(req.block_ids[i])]
        need = max(0, self.blocks_for(end) - len(req.block_ids))
        if need + len(shared) > self.pool.num_free:
            return None
        copies = []
        for i in shared:
            src = req.block_ids[i]
            dst = self.pool.copy_on_write(src)
            copies.append((src, dst))
            req.block_ids[i] = dst
        req.block_ids += self.pool.allocate(need)
        return copies

    def commit(self, req: KVOwner) -> None:
        """Offer every full block of accepted, computed tokens to the prefix cache."""
        if self.prefix_cache.enabled and req.num_computed_tokens // self.block_size > len(req.block_hashes):
            req.block_hashes = self.prefix_cache.register(req.all_token_ids, req.num_computed_tokens,
                                                          req.block_ids, req.block_hashes)

    def truncate(self, req: KVOwner, num_slots: int) -> None:
        """Roll back: keep the blocks covering slots [0, num_slots) and free the rest (they held
        rejected drafts). `num_computed_tokens` must already be <= num_slots."""
        keep = self.blocks_for(num_slots)
        if keep < len(req.block_ids):
            self.pool.free(req.block_ids[keep:])
            del req.block_ids[keep:]
        del req.block_hashes[num_slots // self.block_size:]

    def fork(self, parent: KVOwner, child: KVOwner, num_tokens: int | None = None) -> None:
        """Let `child` share the blocks of `parent`'s first `num_tokens` computed tokens (default: all),
        one more reference each; the first write into a shared block copies it (allocate_slots).
        `child` must hold no blocks."""
        assert not child.block_ids, "fork into a request that already holds blocks"
        n_tok = parent.num_computed_tokens if num_tokens is None else min(num_tokens, parent.num_computed_tokens)
        child.block_ids = parent.block_ids[:self.blocks_for(n_tok)]
        self.pool.touch(child.block_ids)
        child.block_hashes = parent.block_hashes[:n_tok // self.block_size]
        child.num_computed_tokens = n_tok

    def free(self, req: KVOwner) -> None:
        """Release every block of `req` and forget what it had computed."""
        self.pool.free(req.block_ids)
        req.block_ids, req.block_hashes, req.num_computed_tokens = [], [], 0
