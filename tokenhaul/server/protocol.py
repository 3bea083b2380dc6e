"""The OpenAI API's request and response bodies (the subset tokenhaul serves), as pydantic models.

Requests are validated strictly (no "5" for 5); sampling values are checked by SamplingParams, the
one place their rules live. Responses are built as plain dicts on the hot path; the models here
document them in the OpenAPI schema and the tests check the dicts against them."""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Discriminator, Field, Tag, model_validator

from tokenhaul.errors import RequestError
from tokenhaul.sampling_params import SamplingParams, StructuredOutputsParams
from tokenhaul.server.structured import SOURCES, structured_outputs

MAX_N = 16  # choices per call
MAX_STOP = 16  # stop strings per request
MAX_STOP_CHARS = 256  # characters per stop string
MAX_STOP_TOKEN_IDS = 256
MAX_MESSAGES = 1024  # chat messages per request
MAX_TOP_LOGPROBS = 20  # OpenAI's bound on chat's top_logprobs, and vLLM's on prompt_logprobs here
StopText = Annotated[str, Field(max_length=MAX_STOP_CHARS)]
NULL_IS_DEFAULT = ("n", "stream", "echo", "logprobs")  # OpenAI's nullable fields typed here without None
# vLLM's request extras that change the output, which tokenhaul does not serve: refused when set, not ignored
REFUSED_EXTRAS = ("guided_whitespace_pattern", "allowed_token_ids", "bad_words", "truncate_prompt_tokens",
                  "echo")  # echo: chat's only (a completions field)


class _Body(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")


class StreamOptions(_Body):
    include_usage: bool = False
    continuous_usage_stats: bool = False  # vLLM's: every chunk carries the usage so far


class _SamplingFields(_Body):
    model_config = ConfigDict(strict=True, extra="allow")  # unknown fields kept (model_extra), to refuse some
    model: str | None = Field(None, description="the served model's name (default: the served model)")
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    n: int = Field(1, ge=1, le=MAX_N)
    stop: StopText | Annotated[list[StopText], Field(max_length=MAX_STOP)] | None = Field(
        None, description=f"up to {MAX_STOP} strings of at most {MAX_STOP_CHARS} characters")
    seed: int | None = None
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
    guided_json: str | dict[str, Any] | None = None  # vLLM's older names of structured_outputs' kinds
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None

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
            if name in REFUSED_EXTRAS and value not in (None, False, 0, "", [], {}):
                raise RequestError(f"{name} is not supported")
        if self.prompt_logprobs is not None:
            if not 0 <= self.prompt_logprobs <= MAX_TOP_LOGPROBS:
                raise RequestError(f"prompt_logprobs must be in [0, {MAX_TOP_LOGPROBS}], got {self.prompt_logprobs}")
            if self.stream and self.prompt_logprobs > 0:  # vLLM's rule: no chunk carries them
                raise RequestError("prompt_logprobs are not available when stream is true")

    def choice_params(self, max_tokens: int, logprobs: int | None, prompt_logprobs: int | None = None,
                      every_choice: bool = False, tool_schema: dict | None = None) -> list[SamplingParams]:
        """The SamplingParams of one prompt's engine requests: with use_beam_search one, returning the n best
        beams as the n choices; else one per choice. The first asks for `prompt_logprobs` (the choices share a
        prompt), or every one with `every_choice` (a stream, where no choice may wait for another's).
        tool_schema: the JSON schema a chat's tool_choice constrains the output with."""
        so = structured_outputs({name: getattr(self, name) for name in SOURCES} | {"tools": tool_schema})
        if self.use_beam_search:
            return [self.sampling_params(max_tokens, logprobs, n=self.n, prompt_logprobs=prompt_logprobs, so=so)]
        return [self.sampling_params(max_tokens, logprobs, i,
                                     prompt_logprobs=prompt_logprobs if i == 0 or every_choice else None, so=so)
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
                              structured_outputs=so, **kw)

    def _logit_bias(self) -> dict[int, float]:
        """OpenAI's string keys as token ids (their range and the biases are SamplingParams' to check)."""
        out = {}
        for key, bias in (self.logit_bias or {}).items():
            try:
                out[int(key)] = bias
            except ValueError:
                raise RequestError(f"logit_bias keys must be token ids, got {key!r}") from None
        return out


class CompletionRequest(_SamplingFields):
    prompt: str | list[str] | list[int] | list[list[int]]
    logprobs: int | None = None
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = None

    def check_unsupported(self) -> None:
        super().check_unsupported()
        if self.suffix:
            raise RequestError("suffix is not supported")
        if self.best_of is not None and self.best_of != self.n:
            raise RequestError("best_of is not supported (use n)")


class ContentPart(_Body):
    type: str
    text: str | None = None


class FunctionCall(_Body):
    name: str
    arguments: str | dict[str, Any] | None = None  # a JSON object's text (OpenAI); vLLM takes the object too


class ToolCall(_Body):
    id: str | None = None
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(_Body):
    role: str
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None  # an assistant's earlier calls
    tool_call_id: str | None = None  # a tool message's: the call it answers

    def as_template_dict(self) -> dict[str, Any]:
        """The message as vLLM gives it to the chat template: text content, an assistant's tool_calls with their
        arguments parsed to objects (as Qwen's and others' templates expect), a tool message's tool_call_id."""
        content = self.content
        if isinstance(content, list):
            if any(p.type != "text" or p.text is None for p in content):
                raise RequestError("only text content parts are supported")
            content = "\n".join(p.text or "" for p in content)  # as vLLM for a template taking a string
        out: dict[str, Any] = {"role": self.role, "content": content or ""}
        if self.name is not None:
            out["name"] = self.name
        if self.role == "assistant" and self.tool_calls is not None:
            out["tool_calls"] = [{"id": c.id, "type": c.type,
                                  "function": {"name": c.function.name, "arguments": _arguments(c.function)}}
                                 for c in self.tool_calls]
        if self.role == "tool" and self.tool_call_id is not None:
            out["tool_call_id"] = self.tool_call_id
        return out


def _arguments(fn: FunctionCall) -> Any:
    """A call's arguments as an object (vLLM: JSON text parsed, none or empty as {})."""
    if not fn.arguments:
        return {}
    if isinstance(fn.arguments, dict):
        return fn.arguments
    try:
        return json.loads(fn.arguments)
    except ValueError:
        raise RequestError(f"messages: the arguments of the call to {fn.name} are not JSON") from None


def _count_messages_first(data: Any) -> Any:
    """Refuse too many messages before validating each of them (100 k would stall the server)."""
    if isinstance(data, dict) and isinstance(data.get("messages"), list) and len(data["messages"]) > MAX_MESSAGES:
        raise ValueError(f"messages: {len(data['messages'])} messages; at most {MAX_MESSAGES}")
    return data


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1, max_length=MAX_MESSAGES)

    @model_validator(mode="before")
    @classmethod
    def _count_first(cls, data: Any) -> Any:
        return _count_messages_first(data)
    logprobs: bool = False
    top_logprobs: int | None = None
    max_completion_tokens: int | None = None
    tools: list[Any] | None = None  # checked by server/tools.py, which names the field in its 400s
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None  # taken and ignored, as vLLM
    functions: list[Any] | None = None  # OpenAI's deprecated form of tools
    # beyond OpenAI (vLLM's names): continue_final_message continues the last message (an assistant prefill)
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None  # vLLM's: variables for the chat template
    chat_template: str | None = None  # vLLM's: a template sent with the request, refused (as vLLM by default)
    function_call: str | dict[str, Any] | None = None

    def check_unsupported(self) -> None:
        """Refuse what would otherwise be ignored silently (a client would believe functions were on), and
        top_logprobs out of range by its own name (SamplingParams would name the logprobs it becomes)."""
        super().check_unsupported()
        if self.functions:
            raise RequestError("functions are not supported")
        if self.function_call not in (None, "none"):
            raise RequestError("function_call is not supported")
        if self.chat_template:  # vLLM too, unless started trusting request templates
            raise RequestError("chat_template is not supported: the model's own template renders the chat")
        if self.top_logprobs is not None and not 0 <= self.top_logprobs <= MAX_TOP_LOGPROBS:
            raise RequestError(f"top_logprobs must be in [0, {MAX_TOP_LOGPROBS}], got {self.top_logprobs}")


# /tokenize and /detokenize (vLLM's) ---------------------------------------------------------------
class TokenizeCompletionRequest(_Body):
    model: str | None = None
    prompt: str
    add_special_tokens: bool = Field(True, description="add the model's special tokens (e.g. BOS) to the prompt")
    return_token_strs: bool | None = Field(False, description="also return each token's vocabulary string")


class TokenizeChatRequest(_Body):
    model: str | None = None
    messages: list[ChatMessage] = Field(max_length=MAX_MESSAGES)
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None
    tools: list[Any] | None = Field(None, description="tools the chat template renders, as chat completions' tools")
    add_special_tokens: bool = Field(False, description="add special tokens on top of what the chat template adds")
    return_token_strs: bool | None = Field(False, description="also return each token's vocabulary string")

    @model_validator(mode="before")
    @classmethod
    def _check_first(cls, data: Any) -> Any:
        """One prompt: messages or a prompt, not both (either would be ignored); not too many messages."""
        if isinstance(data, dict) and "prompt" in data:
            raise ValueError("prompt and messages: give one of them, not both")
        return _count_messages_first(data)


def _tokenize_kind(data: Any) -> str:
    return "tokenize-chat" if isinstance(data, dict) and "messages" in data else "tokenize-prompt"


# the tags hold '-' so that an error's location drops them (app._union_branch), naming the field as sent
TokenizeRequest = Annotated[Annotated[TokenizeCompletionRequest, Tag("tokenize-prompt")]
                            | Annotated[TokenizeChatRequest, Tag("tokenize-chat")], Discriminator(_tokenize_kind)]


class DetokenizeRequest(_Body):
    model: str | None = None
    tokens: list[int]


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


class CompletionLogprobs(BaseModel):
    """With echo the prompt's tokens come first; its first token has no logprob (None) and no top_logprobs."""

    tokens: list[str]
    token_logprobs: list[float | None]
    top_logprobs: list[dict[str, float] | None] | None = None  # the k most likely and the token (k + 1 at most)
    text_offset: list[int]


class PromptLogprob(BaseModel):
    """vLLM's Logprob: rank is 1-based among the vocabulary."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


# vLLM's prompt_logprobs: per prompt token (None for the first), token id (a string in JSON) → its Logprob: the
# prompt token first, then the k most likely
PromptLogprobs = list[dict[str, PromptLogprob] | None]


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None  # the stop string, or the stop_token_ids id (vLLM)
    prompt_logprobs: PromptLogprobs | None = None  # vLLM's: its prompt's, with prompt_logprobs (or echo + logprobs)


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"]
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class TokenLogprobEntry(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChatLogprobs(BaseModel):
    content: list[TokenLogprobEntry] | None = None


class FunctionCallOut(BaseModel):
    name: str
    arguments: str  # a JSON object's text


class ToolCallOut(BaseModel):
    id: str  # vLLM's chatcmpl-tool-<hex>
    type: Literal["function"]
    function: FunctionCallOut


class AssistantMessage(BaseModel):
    role: Literal["assistant"]
    content: str | None = None
    tool_calls: list[ToolCallOut] | None = None  # with tools: the calls the output makes (server/tools.py)


class DeltaFunctionCall(BaseModel):
    name: str | None = None
    arguments: str | None = None


class DeltaToolCall(BaseModel):
    """A streamed call: its first delta has id, type and name; later ones more of the arguments' text."""

    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: DeltaFunctionCall


class ChatChoice(BaseModel):
    index: int
    message: AssistantMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None  # the stop string, or the stop_token_ids id (vLLM)


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"]
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage | None = None
    prompt_logprobs: PromptLogprobs | None = None  # vLLM's, with prompt_logprobs: the one prompt's


class ChatDelta(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None
    tool_calls: list[DeltaToolCall] | None = None


class ChatChunkChoice(BaseModel):
    index: int
    delta: ChatDelta
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"]
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"]
    created: int
    owned_by: str
    max_model_len: int


class ModelList(BaseModel):
    object: Literal["list"]
    data: list[ModelCard]


class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None  # with return_token_strs


class DetokenizeResponse(BaseModel):
    prompt: str
