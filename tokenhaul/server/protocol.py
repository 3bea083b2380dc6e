"""The OpenAI API's bodies as pydantic models (the subset tokenhaul serves): what every endpoint shares — the
request limits, the sampling fields of completions and chat, errors, usage, vLLM's prompt_logprobs, the model
cards. completion_protocol.py, chat_protocol.py and tokenize_protocol.py hold each endpoint's own.

Requests are validated strictly (no "5" for 5); sampling values are checked by SamplingParams, the
one place their rules live. Responses are built as plain dicts on the hot path; the models here
document them in the OpenAPI schema and the tests check the dicts against them."""

from __future__ import annotations

from typing import Annotated, Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from tokenhaul.errors import RequestError
from tokenhaul.sampling_params import MAX_N, SamplingParams, StructuredOutputsParams
from tokenhaul.server.structured import SOURCES, structured_outputs

MAX_STOP = 16  # stop strings per request
MAX_STOP_CHARS = 256  # characters per stop string
MAX_STOP_TOKEN_IDS = 256
MAX_MESSAGES = 1024  # chat messages per request
MAX_TOP_LOGPROBS = 20  # OpenAI's bound on chat's top_logprobs, and vLLM's on prompt_logprobs here
StopText = Annotated[str, Field(max_length=MAX_STOP_CHARS)]
NULL_IS_DEFAULT = ("n", "stream", "echo", "logprobs")  # OpenAI's nullable fields typed here without None
MAX_BAD_WORDS = 1024  # vLLM's bad_words per request
# vLLM's request extras that change the output, which tokenhaul does not serve: name → vLLM's default; refused
# when set to anything else (null or empty is the default), not ignored. The endpoints add their own.
REFUSED_EXTRAS: dict[str, Any] = {"guided_whitespace_pattern": None, "logits_processors": None,
                                  "early_stopping": False}  # beam search's, vLLM's older name


class RequestBody(BaseModel):
    """A request body: strict types, unknown fields ignored."""

    model_config = ConfigDict(strict=True, extra="ignore")


class StreamOptions(RequestBody):
    include_usage: bool = False
    continuous_usage_stats: bool = False  # vLLM's: every chunk carries the usage so far


class SamplingRequest(RequestBody):
    """The fields completions and chat share: sampling, stops, logprobs, structured outputs (OpenAI's and vLLM's)."""

    model_config = ConfigDict(strict=True, extra="allow")  # unknown fields kept (model_extra), to refuse some
    refused_extras: ClassVar[dict[str, Any]] = REFUSED_EXTRAS
    model: str | None = Field(None, description="the served model's name (default: the served model)")
    max_tokens: int | None = Field(None, description="left out: 16 on completions; null (and chat's default): as "
                                   "many as the context holds after the prompt (vLLM's)")
    temperature: float | None = None
    top_p: float | None = None
    n: int = Field(1, ge=1, le=MAX_N)  # SamplingParams' cap (OpenAI's), as LLM and the CLI
    stop: StopText | Annotated[list[StopText], Field(max_length=MAX_STOP)] | None = Field(
        None, description=f"up to {MAX_STOP} strings of at most {MAX_STOP_CHARS} characters")
    seed: int | None = Field(None, ge=-2**63, lt=2**63, description="int64 (vLLM's range); choice i samples with "
                             "seed + i")
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    # beyond OpenAI (vLLM's names)
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    ignore_eos: bool = False
    min_tokens: int | None = None
    response_format: dict[str, Any] | None = None  # chat's in OpenAI; vLLM takes it in completions too
    stop_token_ids: list[int] | None = Field(None, max_length=MAX_STOP_TOKEN_IDS)
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    use_beam_search: bool = False  # transformers' num_beams semantics; the n choices are the n best beams
    beam_width: int | None = None
    length_penalty: float | None = None
    speculative: str | None = None  # off | prompt_lookup | draft | jacobi (tokenhaul's)
    num_speculative_tokens: int | None = None
    logit_bias: dict[str, float] | None = Field(
        None, description="token id (a string, as OpenAI sends it) → bias in [-100, 100] added to its logit")
    prompt_logprobs: int | None = Field(
        None, description="vLLM's: each prompt token's logprob and the k most likely tokens there (not streamed)")
    structured_outputs: dict[str, Any] | None = Field(
        None, description="vLLM's: one of json (a schema), regex, choice, grammar, json_object the output follows")
    allowed_token_ids: list[int] | None = Field(None, description="vLLM's: only these token ids may be generated")
    bad_words: Annotated[list[StopText], Field(max_length=MAX_BAD_WORDS)] | None = Field(
        None, description="vLLM's: words never generated (at the text's start, or after a space)")
    truncate_prompt_tokens: int | None = Field(
        None, description="vLLM's: only the prompt's last k tokens are run (-1: the model's context length); "
                          "usage counts those")
    guided_json: str | dict[str, Any] | None = None  # vLLM's older names of structured_outputs' kinds
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    return_tokens_as_token_ids: bool | None = Field(
        None, description="vLLM's: logprobs tokens (top_logprobs' too) as 'token_id:N', so that tokens of one text "
                          "(the bytes of a character each read '\ufffd') stay apart")
    return_token_ids: bool | None = Field(
        None, description="vLLM's: the prompt's token ids (prompt_token_ids) and each choice's (token_ids) in the "
                          "response; streamed, the prompt's with each choice's first chunk, each chunk the ids it adds")

    @model_validator(mode="before")
    @classmethod
    def _null_is_default(cls, data: Any) -> Any:
        """OpenAI's null for n, stream, echo or logprobs: the default, as if the field were left out."""
        if isinstance(data, dict) and any(data.get(k, 0) is None for k in NULL_IS_DEFAULT):
            return {k: v for k, v in data.items() if v is not None or k not in NULL_IS_DEFAULT}
        return data

    def check_unsupported(self) -> None:
        """stream_options only with stream (as OpenAI and vLLM: without it no usage chunk could come), and no vLLM
        extra that tokenhaul would otherwise ignore (a client would believe it held)."""
        if self.stream_options is not None and not self.stream:
            raise RequestError("stream_options is only allowed when stream is true")
        for name, value in (self.model_extra or {}).items():
            default = self.refused_extras.get(name, value)
            if value != default and value not in (None, "", [], {}):
                raise RequestError(f"{name} is not supported (it would change the output; tokenhaul does not "
                                   f"serve it)")
        if self.prompt_logprobs is not None:
            if not 0 <= self.prompt_logprobs <= MAX_TOP_LOGPROBS:
                raise RequestError(f"prompt_logprobs must be in [0, {MAX_TOP_LOGPROBS}], got {self.prompt_logprobs}")
            if self.stream and self.prompt_logprobs > 0:  # vLLM's rule: no chunk carries them
                raise RequestError("prompt_logprobs are not available when stream is true")

    def choice_params(self, max_tokens: int, logprobs: int | None, prompt_logprobs: int | None = None,
                      tool_schema: dict | None = None) -> list[SamplingParams]:
        """The SamplingParams of one prompt's engine requests: with use_beam_search one, returning the n best
        beams as the n choices; else one per choice. The first alone asks for `prompt_logprobs` (the choices
        share a prompt; the others hit the prefix cache).
        tool_schema: the JSON schema a chat's tool_choice constrains the output with."""
        so = structured_outputs({name: getattr(self, name) for name in SOURCES} | {"tools": tool_schema})
        if self.use_beam_search:
            return [self.sampling_params(max_tokens, logprobs, n=self.n, prompt_logprobs=prompt_logprobs, so=so)]
        return [self.sampling_params(max_tokens, logprobs, i,
                                     prompt_logprobs=prompt_logprobs if i == 0 else None, so=so)
                for i in range(self.n)]

    def sampling_params(self, max_tokens: int, logprobs: int | None, index: int = 0, n: int = 1,
                        prompt_logprobs: int | None = None,
                        so: StructuredOutputsParams | None = None) -> SamplingParams:
        """SamplingParams of choice `index` (seeds differ per choice: seed + index); `n` beams with beam search."""
        seed = None if self.seed is None else (self.seed + index) % 2**63
        kw: dict[str, Any] = {
            k: v for k, v in (("temperature", self.temperature), ("top_p", self.top_p),
                              ("presence_penalty", self.presence_penalty),
                              ("frequency_penalty", self.frequency_penalty), ("top_k", self.top_k),
                              ("min_p", self.min_p), ("repetition_penalty", self.repetition_penalty),
                              ("min_tokens", self.min_tokens),
                              ("beam_width", self.beam_width), ("length_penalty", self.length_penalty),
                              ("speculative", self.speculative),
                              ("num_speculative_tokens", self.num_speculative_tokens))
            if v is not None
        }
        stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        return SamplingParams(max_tokens=max_tokens, seed=seed, stop=stop, logprobs=logprobs,
                              prompt_logprobs=prompt_logprobs, ignore_eos=self.ignore_eos,
                              stop_token_ids=list(self.stop_token_ids or []),
                              skip_special_tokens=self.skip_special_tokens,
                              include_stop_str_in_output=self.include_stop_str_in_output,
                              use_beam_search=self.use_beam_search, n=n, logit_bias=self._logit_bias(),
                              structured_outputs=so, allowed_token_ids=self.allowed_token_ids,
                              bad_words=list(self.bad_words or []),
                              truncate_prompt_tokens=self.truncate_prompt_tokens, **kw)

    def _logit_bias(self) -> dict[int, float]:
        """OpenAI's string keys as token ids (their range and the biases are SamplingParams' to check)."""
        out = {}
        for key, bias in (self.logit_bias or {}).items():
            try:
                out[int(key)] = bias
            except ValueError:
                raise RequestError(f"logit_bias keys must be token ids, got {key!r}") from None
        return out


# responses ---------------------------------------------------------------------------------------
class ErrorInfo(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    error: ErrorInfo


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class PromptLogprob(BaseModel):
    """vLLM's Logprob: rank is 1-based among the vocabulary."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


# vLLM's prompt_logprobs: per prompt token (None for the first), token id (a string in JSON) → its Logprob: the
# prompt token first, then the k most likely
PromptLogprobs = list[dict[str, PromptLogprob] | None]


class ModelCard(BaseModel):
    id: str
    object: Literal["model"]
    created: int
    owned_by: str
    max_model_len: int


class ModelList(BaseModel):
    object: Literal["list"]
    data: list[ModelCard]
