"""Router: which replica serves a request. Cache-aware by default: a request goes to a replica that
was sent the same leading blocks before (so its prefix cache most likely holds them), unless that
replica is over a load cap; otherwise to the least loaded replica. Plain Python, no Ray, no torch.

Prefix keys are the prefix cache's own chained block hashes (`kv.prefix_cache.chain_hashes`), so a
router match means "the same full blocks" exactly as the engine would see them. A prefix stays with
the replica first sent it (its home) while that one is under the cap, so a spill does not split a hot
prefix over both caches for good. Whatever the policy, the router counts the prompt tokens it sent to
a replica although another had been sent those leading blocks: prefix computed twice across the
cluster, as far as the router knows (a cache may have evicted them meanwhile)."""

from __future__ import annotations

import itertools
from collections import OrderedDict
from dataclasses import dataclass

from tokenhaul.errors import TokenhaulError
from tokenhaul.kv.prefix_cache import chain_hashes

POLICIES = ("cache_aware", "least_loaded", "round_robin")


class NoReplica(TokenhaulError):
    """Every replica is down (restarting or dead)."""


@dataclass
class RouterCounts:
    """Routing decisions since start (monotonic counters)."""

    affinity: int = 0  # sent to a replica that had been sent the same leading blocks
    spilled: int = 0  # had such a replica, but it was over the load cap
    unmatched: int = 0  # no replica had seen its leading blocks: least loaded
    round_robin: int = 0  # policy round_robin: no choice made
    duplicate_tokens: int = 0  # prompt tokens in leading blocks another replica was sent first: computed again


class Router:
    """Route token-id prompts over named replicas; the caller reports each request's end with
    `finish(name)` and a replica's health with `set_up(name, up)`. Not thread-safe (one event loop)."""

    def __init__(self, names: list[str], block_size: int, policy: str = "cache_aware", load_cap: int = 4,
                 max_blocks: int = 64, max_entries: int = 1 << 16) -> None:
        if policy not in POLICIES:
            raise TokenhaulError(f"unknown routing policy '{policy}' (choose from {', '.join(POLICIES)})")
        if not names:
            raise TokenhaulError("a router needs at least one replica")
        self.names = list(names)
        self.block_size = block_size
        self.policy = policy
        self.load_cap = load_cap
        self.max_blocks = max_blocks  # only the leading blocks are hashed: a prompt's head decides
        self.max_entries = max_entries
        self.load = dict.fromkeys(names, 0)  # requests routed and not yet finished
        self.routed = dict.fromkeys(names, 0)  # requests routed since start
        self.up = dict.fromkeys(names, True)
        self.counts = RouterCounts()
        self._owners: OrderedDict[int, dict[str, None]] = OrderedDict()  # block-chain hash → replicas sent it,
        # in the order they were first sent it (LRU over hashes)
        self._rr = itertools.count()

    def route(self, token_ids: list[int]) -> str:
        """Pick a replica for a prompt and count it as loaded by one more request."""
        live = [n for n in self.names if self.up[n]]
        if not live:
            raise NoReplica("no engine replica is up (all are restarting or dead); retry later")
        hashes = chain_hashes(token_ids[: self.max_blocks * self.block_size], self.block_size, [])
        if self.policy == "round_robin":
            name = live[next(self._rr) % len(live)]
            self.counts.round_robin += 1
        else:
            name = self._choose(live, hashes if self.policy == "cache_aware" else [])
        self.counts.duplicate_tokens += self._elsewhere(hashes, name) * self.block_size
        self._remember(hashes, name)
        self.load[name] += 1
        self.routed[name] += 1
        return name

    def finish(self, name: str) -> None:
        """A request routed to `name` has ended (finished, failed, aborted or moved elsewhere)."""
        self.load[name] = max(0, self.load[name] - 1)

    def set_up(self, name: str, up: bool) -> None:
        """Mark a replica up or down; a replica that went down lost its cache, so forget its prefixes."""
        self.up[name] = up
        if not up:
            for h in [h for h, owners in self._owners.items() if list(owners) == [name]]:
                del self._owners[h]
            for owners in self._owners.values():
                owners.pop(name, None)

    def _choose(self, live: list[str], hashes: list[int]) -> str:
        least = self._least_loaded(live)
        owners = self._deepest_owners(hashes, live)
        if not owners:
            self.counts.unmatched += 1
            return least
        best = owners[0]  # the prefix's home: the first replica sent these blocks
        if self.load[best] < self.load[least] + self.load_cap:
            self.counts.affinity += 1
            return best
        self.counts.spilled += 1
        return least

    def _least_loaded(self, live: list[str]) -> str:
        """Least loaded live replica; a tie goes to the one routed fewest requests so far, so
        distinct prompts spread over idle replicas."""
        return min(live, key=lambda n: (self.load[n], self.routed[n], self.names.index(n)))

    def _deepest_owners(self, hashes: list[int], live: list[str]) -> list[str]:
        """Live replicas sent the longest run of these leading blocks, in the order they were first sent
        the deepest block (empty if not even the first block was sent anywhere)."""
        found: list[str] = []
        for h in hashes:
            owners = self._owners.get(h)
            hit = [n for n in owners or () if n in live]
            if not hit:
                break
            self._owners.move_to_end(h)
            found = hit
        return found

    def _elsewhere(self, hashes: list[int], name: str) -> int:
        """Leading blocks of a prompt sent to `name` that another live replica was sent and `name` not."""
        n = 0
        for h in hashes:
            owners = self._owners.get(h)
            if not owners:
                break
            if name not in owners and any(self.up[o] for o in owners):
                n += 1
        return n

    def _remember(self, hashes: list[int], name: str) -> None:
        for h in hashes:
            self._owners.setdefault(h, {})[name] = None
            self._owners.move_to_end(h)
        while len(self._owners) > self.max_entries:
            self._owners.popitem(last=False)
