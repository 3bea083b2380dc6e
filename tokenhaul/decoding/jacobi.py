"""Jacobi / lookahead decoding (Fu et al. 2024), in the engine's propose → verify shape.

Each step verifies a guess of the next k tokens; the target's outputs at the rejected positions are
the next Jacobi iteration of the guess (a fixed-point refinement). n-grams seen along the way go
into a pool keyed by their first token; a pool entry that starts at the last token is proposed
first. Verification is exact, so greedy output equals plain greedy (lossless)."""

from __future__ import annotations

from dataclasses import dataclass, field

from tokenhaul.engine.request import Request


@dataclass
class _State:
    guess: list[int] = field(default_factory=list)  # refined guess of the tokens after the last one
    pool: dict[int, list[int]] = field(default_factory=dict)  # token → the tokens that followed it


class Jacobi:
    writes_kv = False

    def __init__(self, pool_size: int = 1024) -> None:
        self.pool_size = pool_size
        self._state: dict[str, _State] = {}

    def propose(self, reqs: list[Request], ks: list[int]) -> list[None]:
        for r, k in zip(reqs, ks):
            st = self._state.setdefault(r.request_id, _State())
            last = r.output_token_ids[-1] if r.output_token_ids else r.prompt_token_ids[-1]
            draft = list(st.pool.get(last, []))[:k]
            if len(draft) < k:
                guess = st.guess or r.all_token_ids[-k:]  # first iteration: the recent tokens as a guess
                draft += guess[len(draft):k]
            r.draft_token_ids = draft if k > 0 else []
        return [None] * len(reqs)

    def observe(self, req: Request, drafts: list[int], targets: list[int], accepted: int) -> None:
        """targets: the target's argmax after each verified position (k+1 of them)."""
        st = self._state.setdefault(req.request_id, _State())
        st.guess = targets[accepted + 1:]  # one Jacobi iteration past the kept tokens
        last = req.output_token_ids[-1] if req.output_token_ids else req.prompt_token_ids[-1]
        seq = [last] + targets  # called before the kept tokens (targets[:accepted + 1]) are appended
        for i in range(len(seq) - 1):
            st.pool[seq[i]] = seq[i + 1:i + 1 + len(drafts)]
        while len(st.pool) > self.pool_size:
            st.pool.pop(next(iter(st.pool)))

    def forget(self, request_id: str) -> None:
        self._state.pop(request_id, None)
