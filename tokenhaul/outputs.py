"""RequestOutput: what the front end hands to users (text, ids, reason, logprobs, ledger), and its
CompletionOutputs: the n samples or beams of one prompt (vLLM's `out.outputs[i]`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class TokenLogprob:
    token_id: int
    logprob: float
    top: list[tuple[int, float]] | None = None
    rank: int | None = None  # prompt logprobs: 1-based among the vocabulary (tokens at least as likely)


@dataclass
class BeamOutput:
    """One returned beam of a beam search: its tokens, text and score (sum of logprobs / length ** penalty)."""

    token_ids: list[int]
    text: str
    score: float
    finish_reason: str | None = None  # "stop": at a stop token (EOS, stop_token_ids); "length": at the limit
    stop_reason: int | None = None  # the stop_token_ids id it ended at (not at EOS)


@dataclass
class CompletionOutput:
    """One completion of a request, as vLLM's: a sample, or one returned beam of a beam search."""

    index: int
    text: str
    token_ids: list[int]
    # the sum of the tokens' logprobs: None unless logprobs were asked; for a beam, its score × generated
    # length ** length_penalty (BeamOutput.score is the sum divided by that), vLLM's cumulative logprob of a beam
    cumulative_logprob: float | None
    logprobs: list[TokenLogprob] | None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


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
    # vLLM's: the n samples, or the returned beams best first; text, token_ids, ... above are outputs[0]'s
    # (filled by LLM.generate)
    outputs: list[CompletionOutput] = field(default_factory=list)
    ledger: Any = None  # tokenhaul.ledger.Ledger of the generate call, set by LLM.generate
    prompt: str | None = None  # the prompt's text when it was given as text (vLLM's), set by LLM.generate
