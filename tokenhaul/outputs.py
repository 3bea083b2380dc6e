"""RequestOutput: what the front end hands to users (text, ids, reason, logprobs, ledger)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class TokenLogprob:
    token_id: int
    logprob: float
    top: list[tuple[int, float]] | None = None


@dataclass
class BeamOutput:
    """One returned beam of a beam search: its tokens, text and score (sum of logprobs / length ** penalty)."""

    token_ids: list[int]
    text: str
    score: float


@dataclass
class RequestOutput:
    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    delta_text: str = ""  # text added by the latest update (streaming)
    finished: bool = False
    finish_reason: str | None = None
    stop_reason: int | str | None = None  # the stop string matched, or the stop_token_ids id stopped at (vLLM's)
    logprobs: list[TokenLogprob] | None = None
    prompt_logprobs: list[TokenLogprob | None] | None = None  # per prompt token, None for the first (vLLM's)
    beams: list[BeamOutput] | None = None  # beam search: the best n, best first (token_ids/text are beams[0]'s)
    ledger: Any = None  # tokenhaul.ledger.Ledger of the generate call, set by LLM.generate
