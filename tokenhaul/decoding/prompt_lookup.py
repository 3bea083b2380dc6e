"""Prompt lookup (n-gram) drafting: find the latest earlier occurrence of the context's last n tokens
(n from 3 down to 2) in the prompt and the text so far, and propose the tokens that followed it.
Free to propose (no model), so it wins on input-grounded work: rewriting, quoting, summarising."""

from __future__ import annotations

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view

from tokenhaul.engine.request import Request


def lookup(tokens: list[int] | np.ndarray, k: int, max_ngram: int = 3, min_ngram: int = 2) -> list[int]:
    """Up to k tokens that followed the latest earlier match of the longest matching suffix n-gram."""
    arr = np.asarray(tokens)
    for n in range(max_ngram, min_ngram - 1, -1):
        if len(arr) <= n:
            continue
        hits = np.flatnonzero((sliding_window_view(arr[:-1], n) == arr[-n:]).all(1))
        if hits.size:
            full = hits[hits + n + k <= len(arr)]  # prefer the latest match followed by k tokens
            start = int((full if full.size else hits)[-1]) + n
            return arr[start:start + k].tolist()
    return []


class PromptLookup:
    writes_kv = False

    def __init__(self, max_ngram: int = 3, min_ngram: int = 2) -> None:  # 1-grams: mostly wrong guesses
        self.max_ngram = max_ngram
        self.min_ngram = min_ngram

    def propose(self, reqs: list[Request], ks: list[int]) -> list[None]:
        for r, k in zip(reqs, ks):
            r.draft_token_ids = lookup(r.all_token_ids, k, self.max_ngram, self.min_ngram) if k > 0 else []
        return [None] * len(reqs)

    def observe(self, req: Request, drafts: list[int], targets: list[int], accepted: int) -> None:
        pass

    def forget(self, request_id: str) -> None:
        pass
