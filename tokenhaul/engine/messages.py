"""Messages between a front end and an engine core: small plain dataclasses of ints and strings, no
torch, so they cross a thread, a process or a Ray actor boundary unchanged (pickled as they are)."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

from tokenhaul.errors import RequestError
from tokenhaul.sampling_params import SamplingParams


@dataclass
class Sample:
    """One sampled token (or a prompt token, for prompt logprobs) and, when asked for, its logprob and the top
    alternatives."""

    token: int
    logprob: float | None = None
    top_logprobs: list[tuple[int, float]] | None = None  # (token id, logprob), best first
    rank: int | None = None  # with its logprob: 1-based among the vocabulary (tokens at least as likely, as vLLM)


@dataclass
class FinishedBeam:
    """One returned beam of a beam search: its tokens, score (sum of logprobs / length ** length_penalty) and
    why it ended: "stop" at a stop token (EOS unless ignore_eos, or one of stop_token_ids), else "length"."""

    token_ids: list[int]
    score: float
    finish_reason: str
    stop_reason: int | None = None  # the stop_token_ids id it ended at (not at EOS)


@dataclass
class RequestDelta:
    """What one request produced in one step (token ids only; text is the front end's business)."""

    request_id: str
    new_token_ids: list[int]
    finished: bool = False
    finish_reason: str | None = None
    samples: list[Sample] = field(default_factory=list)
    beams: list[FinishedBeam] | None = None  # beam search: the best n, best first
    stop_reason: int | None = None  # finished at this token of stop_token_ids (not at EOS)
    prompt_logprobs: list[Sample | None] | None = None  # asked for: one per prompt token (None for the first),
    #                                                    in the request's first delta only


@dataclass(frozen=True)
class AddRequest:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    eos_token_ids: tuple[int, ...] = ()


@dataclass(frozen=True)
class AbortRequest:
    request_id: str
    reason: str = "abort"


@dataclass(frozen=True)
class CoreLimits:
    """Static facts of a core: what a front end checks before admitting a request."""

    max_model_len: int
    block_size: int
    num_blocks: int
    vocab_size: int
    speculative: tuple[str, ...] = ()  # the speculative methods it serves ("off" always)

    def check_token_ids(self, ids: Iterable[int], what: str = "prompt") -> None:
        """Client-given token ids (of a prompt, or of `what`) must index the model's vocabulary."""
        bad = next((t for t in ids if not (isinstance(t, int) and 0 <= t < self.vocab_size)), None)
        if bad is not None:
            raise RequestError(f"{what} contains token id {bad!r}, outside the vocabulary [0, {self.vocab_size})")

    def check_params(self, params: SamplingParams) -> None:
        """The token ids a request's parameters name must index the vocabulary too (logit_bias's, allowed_token_ids',
        bad words' once tokenized); bad_words reach the core tokenized (SamplingParams.update_from_tokenizer)."""
        self.check_token_ids(params.logit_bias, "logit_bias")
        self.check_token_ids(params.allowed_token_ids or (), "allowed_token_ids")
        self.check_token_ids((t for q in params.bad_words_token_ids for t in q), "bad_words")
        if params.bad_words and not params.bad_words_token_ids:
            raise RequestError("bad_words must be tokenized by the front end before the engine core gets them "
                               "(SamplingParams.update_from_tokenizer)")


@dataclass(frozen=True)
class CoreStats:
    """A snapshot of a core's state and counters (replaced, never mutated)."""

    num_running: int = 0
    num_waiting: int = 0
    kv_blocks_used: int = 0
    kv_blocks_cached: int = 0
    kv_blocks_total: int = 0
    prefix_hit_tokens: int = 0
    prefix_query_tokens: int = 0
    num_preemptions: int = 0
    num_steps: int = 0
    step_seconds: float = 0.0  # total time spent inside core.step(), timed by the loop that calls it


@dataclass
class CoreOutputs:
    """What a core's loop hands out after a step: deltas, requests it could not serve, or its death."""

    step: int
    deltas: list[RequestDelta] = field(default_factory=list)
    failed: list[tuple[str, str]] = field(default_factory=list)  # (request id, one-line reason)
    # requests the core refused at admission (it can never serve them): (request id, "capacity" (KV pool, seats) or
    # "request" (its parameters), one-line reason); a front end answers them as bad requests, not engine failures
    refused: list[tuple[str, str, str]] = field(default_factory=list)
    dead: str | None = None  # the loop itself died: every request it was given is lost
