"""vLLM's /tokenize and /detokenize request and response bodies (pydantic; see protocol.py)."""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import BaseModel, Discriminator, Field, Tag, model_validator

from tokenhaul.server.chat_protocol import ChatMessage, count_messages_first
from tokenhaul.server.protocol import MAX_MESSAGES, RequestBody


class TokenizeCompletionRequest(RequestBody):
    model: str | None = None
    prompt: str
    add_special_tokens: bool = Field(True, description="add the model's special tokens (e.g. BOS) to the prompt")
    return_token_strs: bool | None = Field(False, description="also return each token's vocabulary string")


class TokenizeChatRequest(RequestBody):
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
        return count_messages_first(data)


def _tokenize_kind(data: Any) -> str:
    return "tokenize-chat" if isinstance(data, dict) and "messages" in data else "tokenize-prompt"


# the tags hold '-' so that an error's location drops them (app._union_branch), naming the field as sent
TokenizeRequest = Annotated[Annotated[TokenizeCompletionRequest, Tag("tokenize-prompt")]
                            | Annotated[TokenizeChatRequest, Tag("tokenize-chat")], Discriminator(_tokenize_kind)]


class DetokenizeRequest(RequestBody):
    model: str | None = None
    tokens: list[int]


class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None  # with return_token_strs


class DetokenizeResponse(BaseModel):
    prompt: str
