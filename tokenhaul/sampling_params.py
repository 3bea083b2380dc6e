"""SamplingParams: what a request asks of the decoder; validated once, with one-line errors."""

from __future__ import annotations

import copy
import math
from collections.abc import Callable, Collection
from dataclasses import dataclass, field

from tokenhaul.errors import RequestError
from tokenhaul.structured_outputs import StructuredOutputsParams

__all__ = ["SamplingParams", "StructuredOutputsParams"]

SPECULATIVE = ("off", "prompt_lookup", "draft", "jacobi")
MAX_N = 128  # samples or beams per request (OpenAI's cap)


@dataclass
class SamplingParams:
    max_tokens: int | None = 16  # None: up to the context's end (vLLM's)
    temperature: float = 1.0  # 0 → greedy
    top_k: int = 0  # 0 or -1 → off
    top_p: float = 1.0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None
    ignore_eos: bool = False
    stop_token_ids: list[int] = field(default_factory=list)
    stop: list[str] = field(default_factory=list)
    include_stop_str_in_output: bool = False
    logprobs: int | None = None  # number of top logprobs per token (0 → only the chosen token's)
    prompt_logprobs: int | None = None  # the same for each prompt token (vLLM's; the first has none)
    skip_special_tokens: bool = True
    speculative: str = "off"  # "off" | "prompt_lookup" | "draft" | "jacobi" (decoding/)
    num_speculative_tokens: int = 4  # most drafts per step; adapted per request between 1 and this
    use_beam_search: bool = False  # transformers' num_beams semantics (decoding/beam.py); deterministic
    beam_width: int = 4
    length_penalty: float = 1.0  # finished beam score = sum of logprobs / generated length ** this
    early_stopping: bool = False  # True: stop once beam_width beams have finished
    n: int = 1  # beams returned (best first, with scores); > 1 only with use_beam_search
    logit_bias: dict[int, float] = field(default_factory=dict)  # token id → added to its logit, in [-100, 100]
    min_tokens: int = 0  # EOS and stop_token_ids cannot be sampled before this many output tokens (vLLM's)
    structured_outputs: StructuredOutputsParams | None = None  # constrained decoding (json / regex / choice / ...)
    allowed_token_ids: list[int] | None = None  # vLLM's: only these tokens may be sampled
    bad_words: list[str] = field(default_factory=list)  # vLLM's: words never generated (see update_from_tokenizer)
    truncate_prompt_tokens: int | None = None  # vLLM's: the front end keeps only the prompt's last k tokens (-1:
    #                                            the context's length)
    detokenize: bool = True  # vLLM's: False returns token ids only (no text: no stop strings either)
    # bad_words as token sequences (both with and without a leading space), set by the front end's tokenizer:
    # a sequence's last token is banned wherever the output so far ends with the rest of it
    bad_words_token_ids: list[list[int]] = field(default_factory=list, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if self.stop is None:  # vLLM's None: no stop strings / stop tokens
            self.stop = []
        if self.stop_token_ids is None:
            self.stop_token_ids = []
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        if self.bad_words is None or isinstance(self.bad_words, str):
            self.bad_words = [] if self.bad_words is None else [self.bad_words]
        self._check_types()
        self.stop = [s for s in self.stop if s]
        self.stop_token_ids = list(self.stop_token_ids)
        if self.top_k == -1:
            self.top_k = 0
        self.logit_bias = _checked_bias(self.logit_bias)
        self.bad_words = list(self.bad_words)
        if self.allowed_token_ids is not None:
            self.allowed_token_ids = list(self.allowed_token_ids)
        if isinstance(self.structured_outputs, dict):
            self.structured_outputs = _structured(self.structured_outputs)
        checks = [
            (self.max_tokens is None or self.max_tokens > 0,
             f"max_tokens must be a positive integer (or None), got {self.max_tokens!r}"),
            (0 <= self.min_tokens <= (self.min_tokens if self.max_tokens is None else self.max_tokens),
             f"min_tokens must be in [0, max_tokens={self.max_tokens}], got {self.min_tokens}"),
            (self.temperature >= 0, f"temperature must be >= 0, got {self.temperature}"),
            (1e-8 <= self.top_p <= 1, f"top_p must be in [1e-8, 1], got {self.top_p}"),  # fp32 keeps it > 0
            (self.top_k >= 0, f"top_k must be >= 0 (or -1 to disable), got {self.top_k}"),
            (0 <= self.min_p <= 1, f"min_p must be in [0, 1], got {self.min_p}"),
            (1e-4 <= self.repetition_penalty <= 1e4,  # beyond, logits overflow fp32
             f"repetition_penalty must be in [1e-4, 1e4], got {self.repetition_penalty}"),
            (-2 <= self.presence_penalty <= 2, f"presence_penalty must be in [-2, 2], got {self.presence_penalty}"),
            (-2 <= self.frequency_penalty <= 2,
             f"frequency_penalty must be in [-2, 2], got {self.frequency_penalty}"),
            (self.logprobs is None or 0 <= self.logprobs <= 20, f"logprobs must be in [0, 20], got {self.logprobs}"),
            (self.prompt_logprobs is None or 0 <= self.prompt_logprobs <= 20,
             f"prompt_logprobs must be in [0, 20], got {self.prompt_logprobs}"),
            (self.speculative in SPECULATIVE,
             f"speculative must be one of {', '.join(SPECULATIVE)}, got {self.speculative!r}"),
            (isinstance(self.num_speculative_tokens, int) and 1 <= self.num_speculative_tokens <= 16,
             f"num_speculative_tokens must be an integer in [1, 16], got {self.num_speculative_tokens!r}"),
            (isinstance(self.beam_width, int) and 1 <= self.beam_width <= 64,
             f"beam_width must be an integer in [1, 64], got {self.beam_width!r}"),
            (isinstance(self.n, int) and 1 <= self.n <= (self.beam_width if self.use_beam_search else MAX_N),
             f"n must be an integer in [1, {MAX_N}], and at most beam_width with use_beam_search, got {self.n!r}"),
            (self.detokenize or not self.stop, "stop strings need detokenize=True (they are matched in the text)"),
            (self.structured_outputs is None or isinstance(self.structured_outputs, StructuredOutputsParams),
             f"structured_outputs must be a StructuredOutputsParams, got {type(self.structured_outputs).__name__}"),
            (self.structured_outputs is None or (self.speculative == "off" and not self.use_beam_search),
             "structured_outputs does not combine with speculative decoding or use_beam_search"),
            (not self.use_beam_search or (self.speculative == "off" and not self.adjusts_logits and not self.bad_words
                                          and self.logprobs is None and self.prompt_logprobs is None
                                          and not self.stop),
             "use_beam_search does not combine with speculative, penalties, logit_bias, min_tokens, allowed_token_ids, "
             "bad_words, logprobs or "
             "prompt_logprobs (beams carry scores) or stop strings (beams end at stop_token_ids and EOS)"),
            (not self.use_beam_search or ((self.greedy or self.temperature == 1.0) and self.top_k == 0
                                          and self.top_p == 1.0 and self.min_p == 0.0 and self.seed is None),
             "use_beam_search does not combine with temperature, top_k, top_p, min_p or seed (beams are chosen "
             "by their logprobs, deterministically): temperature must be 0 (or unset), top_k 0 or -1, top_p 1, "
             "min_p 0, and seed unset"),
        ]
        for ok, msg in checks:
            if not ok:
                raise RequestError(msg)

    def _check_types(self) -> None:
        """Values of the wrong type fail here, with one line, not later inside the engine's tensor code."""
        floats = (self.temperature, self.top_p, self.min_p, self.repetition_penalty, self.presence_penalty,
                  self.frequency_penalty, self.length_penalty)
        checks = [
            (all(_is_number(x) and math.isfinite(x) for x in floats), "sampling values must be finite numbers"),
            (self.max_tokens is None or _is_int(self.max_tokens),
             f"max_tokens must be a positive integer (or None), got {self.max_tokens!r}"),
            (_is_int(self.min_tokens), f"min_tokens must be an integer in [0, max_tokens], got {self.min_tokens!r}"),
            (_is_int(self.top_k), f"top_k must be an integer (0 or -1 to disable), got {self.top_k!r}"),
            (self.logprobs is None or _is_int(self.logprobs),
             f"logprobs must be an integer in [0, 20], got {self.logprobs!r}"),
            (self.prompt_logprobs is None or _is_int(self.prompt_logprobs),
             f"prompt_logprobs must be an integer in [0, 20], got {self.prompt_logprobs!r}"),
            (self.seed is None or (_is_int(self.seed) and -2**63 <= self.seed < 2**64),
             f"seed must be an integer in [-2**63, 2**64), got {self.seed!r}"),
            (isinstance(self.stop, (list, tuple)) and all(isinstance(s, str) for s in self.stop),
             f"stop must be a string or a list of strings, got {self.stop!r}"),
            (isinstance(self.stop_token_ids, (list, tuple)) and all(_is_int(t) and t >= 0 for t in self.stop_token_ids),
             f"stop_token_ids must be a list of token ids (integers >= 0), got {self.stop_token_ids!r}"),
            (self.allowed_token_ids is None or (isinstance(self.allowed_token_ids, (list, tuple))
                                                and len(self.allowed_token_ids) > 0
                                                and all(_is_int(t) and t >= 0 for t in self.allowed_token_ids)),
             f"allowed_token_ids must be a non-empty list of token ids (integers >= 0), "
             f"got {self.allowed_token_ids!r}"),
            (isinstance(self.bad_words, (list, tuple))
             and all(isinstance(w, str) and w.strip() for w in self.bad_words),
             f"bad_words must be a list of non-blank strings, got {self.bad_words!r}"),
            (self.truncate_prompt_tokens is None or (_is_int(self.truncate_prompt_tokens)
                                                     and (self.truncate_prompt_tokens >= 1
                                                          or self.truncate_prompt_tokens == -1)),
             f"truncate_prompt_tokens must be a positive integer or -1 (the context's length), "
             f"got {self.truncate_prompt_tokens!r}"),
        ]
        for ok, msg in checks:
            if not ok:
                raise RequestError(msg)

    def clone(self) -> SamplingParams:
        """A deep copy (vLLM's), the front end's tokenized bad words included."""
        return copy.deepcopy(self)

    @property
    def greedy(self) -> bool:
        return self.temperature < 1e-5  # as vLLM: dividing logits by less overflows fp32

    @property
    def adjusts_logits(self) -> bool:
        """Penalties, a logit bias, min_tokens, allowed tokens, bad words or a structured output's mask change the
        logits before sampling (greedy too: no fast argmax)."""
        return (self.structured_outputs is not None or self.min_tokens > 0 or self.repetition_penalty != 1.0
                or self.presence_penalty != 0.0 or self.frequency_penalty != 0.0 or bool(self.logit_bias)
                or self.allowed_token_ids is not None or bool(self.bad_words_token_ids))

    def update_from_tokenizer(self, encode: Callable[[str], list[int]]) -> None:
        """Tokenize bad_words (the front end calls this; `encode` adds no special tokens): each word as written
        without its leading spaces, and with one leading space where that gives other tokens (the word inside text
        rather than at its start). vLLM keeps the spaced form only at the same token count, so there "Berlin"
        ("Ber", "lin") does not ban " Berlin" (one token); here it does."""
        seqs: list[list[int]] = []
        for word in self.bad_words:
            plain = encode(word.lstrip())
            seqs.append(plain)
            spaced = encode(" " + word.lstrip())
            if spaced and spaced[0] != (plain or [None])[0]:
                seqs.append(spaced)
        self.bad_words_token_ids = [q for q in seqs if q]

    def check_served(self, speculative: Collection[str]) -> None:
        """Refuse a speculative method the engine does not serve (its proposers: `speculative`)."""
        if self.speculative != "off" and self.speculative not in speculative:
            raise RequestError(f"speculative={self.speculative!r} needs an engine started with a draft model "
                               f"(--draft-model)")


def truncate_prompt(token_ids: list[int], k: int | None, max_model_len: int) -> list[int]:
    """vLLM's truncate_prompt_tokens, which the front ends apply: the prompt's last k ids (-1: max_model_len; None:
    all of them; other values are SamplingParams' to refuse)."""
    if k is None or (k < 1 and k != -1):
        return token_ids
    return token_ids[-(max_model_len if k == -1 else k):]


def _is_int(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _is_number(x: object) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def _structured(fields: dict) -> StructuredOutputsParams:
    """A dict of StructuredOutputsParams' fields (as a server passes them) → the params; unknown keys refused."""
    unknown = sorted(set(fields) - set(StructuredOutputsParams.__dataclass_fields__))
    if unknown:
        raise RequestError(f"structured_outputs does not take {', '.join(map(str, unknown))}")
    return StructuredOutputsParams(**fields)


def _checked_bias(bias: object) -> dict[int, float]:
    """logit_bias as {token id: float}: ids integers >= 0, biases finite in [-100, 100] (OpenAI's range)."""
    if bias is None:
        return {}
    if not isinstance(bias, dict):
        raise RequestError(f"logit_bias must map token ids to biases, got {type(bias).__name__}")
    out = {}
    for tid, b in bias.items():
        if not isinstance(tid, int) or isinstance(tid, bool) or tid < 0:
            raise RequestError(f"logit_bias keys must be token ids (integers >= 0), got {tid!r}")
        if not isinstance(b, (int, float)) or isinstance(b, bool) or not -100 <= b <= 100:  # NaN fails the range
            raise RequestError(f"logit_bias values must be numbers in [-100, 100], got {b!r} for token {tid}")
        out[tid] = float(b)
    return out
