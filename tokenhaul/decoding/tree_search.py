"""Tree search (MCTS) over continuations: nodes are token paths from the prompt, children come from
the model's top-k at the node, leaves are scored by a user reward on a greedy rollout (default: the
mean log-probability of the whole continuation), and UCT picks where to look next.

Each level picks up to `width` distinct leaves (UCT with virtual visits, so one level spreads out)
and runs their rollouts as one batch through the engine. Branches share KV by fork: every rollout's
blocks are kept (a KVHolder) until the search ends, and a rollout from a node starts from the blocks
of the rollout that walked the node's path, up to the branch point (copy-on-write for the partial
block), so it computes only its own new token before decoding. A rollout also returns the top-k at
every position of its greedy path, so the nodes along it expand for free."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from tokenhaul.kv.manager import KVHolder
from tokenhaul.sampling_params import SamplingParams

if TYPE_CHECKING:
    from tokenhaul.llm import LLM


@dataclass
class Rollout:
    """One complete continuation of the prompt, as scored."""

    token_ids: list[int]
    logprobs: list[float]  # of each token, from the model
    text: str
    finish_reason: str | None
    reward: float = 0.0
    level: int = 0  # the tree level whose batch produced it (0: the greedy rollout from the root)


Reward = Callable[[Rollout], float]


def mean_logprob(r: Rollout) -> float:
    return sum(r.logprobs) / max(1, len(r.logprobs))


@dataclass
class Node:
    token_ids: list[int]  # the path from the root
    logprobs: list[float]  # of each token on the path
    parent: Node | None = None
    children: list[Node] = field(default_factory=list)
    visits: int = 0
    value: float = 0.0  # sum of rewards through this node
    tail: list[tuple[int, float, list[tuple[int, float]]]] | None = None  # known greedy path below: (token,
    #                                             logprob, top-k at that position); None until rolled out
    tail_reward: float = 0.0  # the reward of the rollout that walked the known path
    done: bool = False  # the path itself is complete (stop token or length): nothing to expand
    kv: KVHolder | None = None  # the KV of the rollout that walked this path (prompt + path + its tail)

    def uct(self, c: float, parent_visits: int) -> float:
        """Mean reward + c·sqrt(ln N / n); a child never visited comes first."""
        if self.visits == 0:
            return math.inf
        return self.value / self.visits + c * math.sqrt(math.log(max(1, parent_visits)) / self.visits)


@dataclass
class SearchResult:
    best: Rollout
    greedy: Rollout
    rollouts: list[Rollout]
    levels: int
    root: Node
    prompt_tokens: int = 0  # rollout prompt tokens (prompt + tree path), all levels
    computed_prompt_tokens: int = 0  # of those, computed (the rest came from forked or cached blocks)


class TreeSearch:
    """MCTS over an LLM's continuations of one prompt (see the module docstring)."""

    def __init__(self, llm: LLM, reward: Reward = mean_logprob, *, width: int = 4, top_k: int = 4,
                 max_tokens: int = 64, c_uct: float = 1.0, stop: list[str] | None = None) -> None:
        self.llm, self.reward, self.width, self.top_k = llm, reward, width, top_k
        self.max_tokens, self.c, self.stop = max_tokens, c_uct, list(stop or [])
        self.stops = set(llm.tokenizer.eos_token_ids)

    def search(self, prompt: str | list[int], levels: int = 4) -> SearchResult:
        """Greedy rollout from the root, then up to `levels` levels of UCT-chosen batched rollouts."""
        ids = self.llm.encode(prompt)
        root = Node([], [])
        rollouts: list[Rollout] = []
        self._complete: list[Rollout] = []  # paths found complete on expansion (a stop token in the top-k)
        level = 0
        self._held: list[KVHolder] = []
        self._tokens = [0, 0]  # rollout prompt tokens, computed ones
        try:
            for level in range(levels + 1):
                leaves = [root] if level == 0 else self._select(root)
                if not leaves:
                    break
                rollouts += self._roll_out(ids, leaves, level)
        finally:
            for h in self._held:
                self.llm.core.release(h)
        rollouts += self._complete
        return SearchResult(max(rollouts, key=lambda r: r.reward), rollouts[0], rollouts, level, root,
                            *self._tokens)

    # one level ---------------------------------------------------------------------------------
    def _select(self, root: Node) -> list[Node]:
        """Up to `width` distinct leaves never rolled out, by UCT with a virtual visit on each pick."""
        picked: list[Node] = []
        virtual: dict[int, int] = {}
        for _ in range(self.width):
            node = root
            while node.children or (node.tail is not None and not node.done):
                if not node.children:
                    self._expand(node)
                    continue
                n = node.visits + virtual.get(id(node), 0)
                open_ = [ch for ch in node.children if not self._exhausted(ch, picked)]
                if not open_:
                    break
                node = max(open_, key=lambda ch: (ch.uct(self.c, n) - virtual.get(id(ch), 0),
                                                  ch.logprobs[-1]))
                virtual[id(node)] = virtual.get(id(node), 0) + 1
            if node.tail is not None or node.done or node in picked:
                break  # the tree under the root holds nothing more to roll out
            picked.append(node)
            p = node
            while p is not None:
                virtual[id(p)] = virtual.get(id(p), 0) + 1
                p = p.parent
        return picked

    def _exhausted(self, node: Node, picked: list[Node]) -> bool:
        """Nothing left to roll out under node (complete paths, everything rolled out, or picked)."""
        if node in picked or node.done:
            return True
        if node.tail is None:
            return False
        if not node.children:
            return False  # expands on the way down
        return all(self._exhausted(ch, picked) for ch in node.children)

    def _roll_out(self, ids: list[int], leaves: list[Node], level: int) -> list[Rollout]:
        """Greedy rollouts from every leaf as one batch; rewards back up the tree."""
        params = [SamplingParams(max_tokens=self.max_tokens - len(n.token_ids), temperature=0, logprobs=self.top_k,
                                 stop=self.stop) for n in leaves]
        held = [KVHolder() for _ in leaves]
        self._held += held
        outs = self.llm.generate([ids + n.token_ids for n in leaves], params, keep_kv=held,
                                 fork_from=[n.parent.kv if n.parent else None for n in leaves])
        self._tokens[0] += sum(len(ids) + len(n.token_ids) for n in leaves)
        self._tokens[1] += outs[0].ledger.prompt_tokens
        rollouts = []
        for node, out, kv in zip(leaves, outs, held):
            node.kv = kv
            lps = zip(out.outputs[0].logprobs or [], out.token_ids)
            tail = [(t, d[t].logprob, _top(d, self.top_k)) for d, t in lps]
            r = self._score(node.token_ids + out.token_ids, node.logprobs + [lp for _, lp, _ in tail],
                            out.finish_reason, level)
            node.tail = tail
            node.tail_reward = r.reward
            self._backup(node, r.reward)
            rollouts.append(r)
        return rollouts

    def _expand(self, node: Node) -> None:
        """Children from the top-k at the node; the greedy child inherits the rest of the known path."""
        assert node.tail
        tok, _, top = node.tail[0]
        for t, lp in top or [(tok, node.tail[0][1])]:
            child = Node(node.token_ids + [t], node.logprobs + [lp], node)
            if t == tok:
                child.tail, child.tail_reward, child.kv = node.tail[1:], node.tail_reward, node.kv
                child.visits, child.value = 1, node.tail_reward
                child.done = not child.tail
            elif t in self.stops or len(child.token_ids) >= self.max_tokens:
                child.done = True  # a complete path: score it as it is
                r = self._score(child.token_ids, child.logprobs, "stop" if t in self.stops else "length", -1)
                self._backup(child, r.reward)
                self._complete.append(r)
            node.children.append(child)

    def _score(self, tokens: list[int], logprobs: list[float], reason: str | None, level: int) -> Rollout:
        r = Rollout(tokens, logprobs, self.llm.tokenizer.decode(tokens), reason, level=level)
        r.reward = float(self.reward(r))
        return r

    @staticmethod
    def _backup(node: Node, reward: float) -> None:
        while node is not None:
            node.visits += 1
            node.value += reward
            node = node.parent


def _top(d: dict, k: int) -> list[tuple[int, float]]:
    """The k most likely (token id, logprob) of a position's logprobs (vLLM's dict: ranks 1..k), best first."""
    return [(tid, lp) for _, tid, lp in sorted((v.rank, tid, v.logprob) for tid, v in d.items()
                                               if v.rank is not None and v.rank <= k)]


def tree_search(llm: LLM, prompt: str | list[int], reward: Reward = mean_logprob, levels: int = 4,
                **kw) -> SearchResult:
    """MCTS over continuations of `prompt`: `levels` batched levels of `width` rollouts each."""
    return TreeSearch(llm, reward, **kw).search(prompt, levels)
