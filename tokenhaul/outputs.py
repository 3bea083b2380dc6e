"""RequestOutput: what the front end hands to users (text, ids, reason, logprobs, ledger), and its
CompletionOutputs: the n samples or beams of one prompt (vLLM's `out.outputs[i]`).

Logprobs come in two shapes. The engine's front end (text/output_processor.py, and the HTTP server that reads it)
keeps one TokenLogprob per token. The offline API (LLM.generate / LLM.chat) returns vLLM's: per token a dict
token id -> Logprob (vllm.logprobs.Logprob) of the token itself and the k most likely, so code ported from vLLM
reads `out.outputs[0].logprobs[i][token_id].logprob` and `.decoded_token`; LLM.generate turns the one into the
other (vllm_logprobs) as it returns."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any


@dataclass
class Logprob:
    """vLLM's Logprob (`from vllm.logprobs import Logprob`; also `tokenhaul.Logprob`): one token's logprob at one
    position, its rank among the vocabulary (1-based: the tokens at least as likely, itself included; a top-k
    entry's is its place 1..k) and its text (the tokenizer's decode of that single id, special tokens shown)."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


LogprobDict = dict[int, Logprob]  # vLLM's per-position logprobs: token id -> Logprob


@dataclass
class TokenLogprob:
    """The front end's logprobs of one token (what the HTTP server reads): its own, the top (token id, logprob)
    pairs best first, and its rank among the vocabulary (1-based: tokens at least as likely, itself included;
    computed by the sampler for generated tokens and by decoding/prompt_logprobs.py for prompt tokens)."""

    token_id: int
    logprob: float
    top: list[tuple[int, float]] | None = None
    rank: int | None = None


def vllm_logprobs(lps: list[TokenLogprob | None], text: Callable[[int], str]) -> list[LogprobDict | None]:
    """TokenLogprobs as vLLM's dicts: per position the token first, then the top k in rank order (k or k + 1
    entries: the token among the top is one key, with its place there as its rank, as vLLM); None stays None
    (the first prompt token). text: a token id's decoded_token."""
    out: list[LogprobDict | None] = []
    for lp in lps:
        if lp is None:
            out.append(None)
            continue
        top = lp.top or []
        rank = next((r for r, (tid, _) in enumerate(top, 1) if tid == lp.token_id), lp.rank)
        d = {lp.token_id: Logprob(lp.logprob, rank, text(lp.token_id))}
        for r, (tid, v) in enumerate(top, 1):
            if tid not in d:
                d[tid] = Logprob(v, r, text(tid))
        out.append(d)
    return out


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
    # vLLM's: None unless SamplingParams.logprobs was given (a beam's are None); else one dict per generated token,
    # token id -> Logprob of the sampled token (its rank among the vocabulary) and the `logprobs` most likely
    # (ranks 1..k); raw model logprobs (before temperature, penalties, logit_bias), as vLLM's default
    logprobs: list[LogprobDict] | None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


@dataclass
class RequestOutput:
    """One prompt's output. From the engine's front end (OutputProcessor; what the HTTP server reads) logprobs and
    prompt_logprobs hold TokenLogprobs; LLM.generate / LLM.chat return them in vLLM's shape, as dicts
    token id -> Logprob (see CompletionOutput.logprobs)."""

    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    delta_text: str = ""  # text added by the latest update (streaming)
    finished: bool = False
    finish_reason: str | None = None
    stop_reason: int | str | None = None  # the stop string matched, or the stop_token_ids id stopped at (vLLM's)
    # per generated token (not vLLM's field): offline, outputs[0].logprobs; from the front end, TokenLogprobs
    logprobs: list[LogprobDict] | list[TokenLogprob] | None = None
    # vLLM's: None unless SamplingParams.prompt_logprobs was given; else per prompt token, None for the first (it
    # follows nothing), then offline a dict token id -> Logprob of the prompt token (its rank among the
    # vocabulary) and the `prompt_logprobs` most likely (ranks 1..k); from the front end, TokenLogprobs
    prompt_logprobs: list[LogprobDict | None] | list[TokenLogprob | None] | None = None
    beams: list[BeamOutput] | None = None  # beam search: the best n, best first (token_ids/text are beams[0]'s)
    # vLLM's: the n samples, or the returned beams best first; text, token_ids, ... above are outputs[0]'s
    # (filled by LLM.generate)
    outputs: list[CompletionOutput] = field(default_factory=list)
    ledger: Any = None  # tokenhaul.ledger.Ledger of the generate call, set by LLM.generate
    prompt: str | None = None  # the prompt's text when it was given as text (vLLM's), set by LLM.generate
