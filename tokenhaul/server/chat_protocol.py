"""/v1/chat/completions' request and response bodies (pydantic; see protocol.py): messages (with an assistant's
earlier tool calls), the request's tools, the response's and the stream's chunks."""

from __future__ import annotations

import json
from typing import Any, Literal, get_args

from pydantic import BaseModel, Field, field_validator, model_validator

from tokenhaul.errors import RequestError
from tokenhaul.server.protocol import (
    MAX_MESSAGES,
    MAX_TOP_LOGPROBS,
    REFUSED_EXTRAS,
    PromptLogprobs,
    RequestBody,
    SamplingRequest,
    Usage,
)


class ContentPart(RequestBody):
    type: str
    text: str | None = None


class FunctionCall(RequestBody):
    name: str
    arguments: str | dict[str, Any] | None = None  # a JSON object's text (OpenAI); vLLM takes the object too


class ToolCall(RequestBody):
    id: str | None = None
    type: Literal["function"] = "function"
    function: FunctionCall


Role = Literal["system", "developer", "user", "assistant", "tool", "function"]  # OpenAI's (function: deprecated)


class ChatMessage(RequestBody):
    role: Role
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None  # an assistant's earlier calls
    tool_call_id: str | None = None  # a tool message's: the call it answers

    @field_validator("role", mode="before")
    @classmethod
    def _known_role(cls, role: Any) -> Any:
        """An unknown role is a 400 naming it (OpenAI's), not a message the template would drop silently."""
        if isinstance(role, str) and role not in get_args(Role):
            raise ValueError(f"invalid role {role!r}: one of {', '.join(get_args(Role))}")
        return role

    def as_template_dict(self) -> dict[str, Any]:
        """The message as vLLM gives it to the chat template: text content, an assistant's tool_calls with their
        arguments parsed to objects (as Qwen's and others' templates expect), a tool message's tool_call_id (a
        developer message is rendered as a system one: Tokenizer.apply_chat_template)."""
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


def count_messages_first(data: Any) -> Any:
    """Refuse too many messages before validating each of them (100 k would stall the server)."""
    if isinstance(data, dict) and isinstance(data.get("messages"), list) and len(data["messages"]) > MAX_MESSAGES:
        raise ValueError(f"messages: {len(data['messages'])} messages; at most {MAX_MESSAGES}")
    return data


class ChatCompletionRequest(SamplingRequest):
    refused_extras = REFUSED_EXTRAS | {"echo": False, "add_special_tokens": False, "documents": None}
    messages: list[ChatMessage] = Field(min_length=1, max_length=MAX_MESSAGES)

    @model_validator(mode="before")
    @classmethod
    def _count_first(cls, data: Any) -> Any:
        return count_messages_first(data)
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
    token_ids: list[int] | None = None  # vLLM's, with return_token_ids


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"]
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage | None = None
    prompt_logprobs: PromptLogprobs | None = None  # vLLM's, with prompt_logprobs: the one prompt's
    prompt_token_ids: list[int] | None = None  # vLLM's, with return_token_ids


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
    token_ids: list[int] | None = None  # vLLM's, with return_token_ids: the ids this chunk adds


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"]
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = None
    prompt_token_ids: list[int] | None = None  # vLLM's, with return_token_ids: in each choice's first
