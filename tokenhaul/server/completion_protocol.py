"""/v1/completions' request and response bodies (pydantic; see protocol.py)."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel

from tokenhaul.errors import RequestError
from tokenhaul.server.protocol import REFUSED_EXTRAS, PromptLogprobs, SamplingRequest, Usage


class CompletionRequest(SamplingRequest):
    refused_extras = REFUSED_EXTRAS | {"prompt_embeds": None, "add_special_tokens": True}
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


class CompletionLogprobs(BaseModel):
    """With echo the prompt's tokens come first; its first token has no logprob (None) and no top_logprobs."""

    tokens: list[str]
    token_logprobs: list[float | None]
    top_logprobs: list[dict[str, float] | None] | None = None  # the k most likely and the token (k + 1 at most)
    text_offset: list[int]


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None  # the stop string, or the stop_token_ids id (vLLM)
    prompt_logprobs: PromptLogprobs | None = None  # vLLM's: its prompt's, with prompt_logprobs (or echo + logprobs)
    prompt_token_ids: list[int] | None = None  # vLLM's, with return_token_ids (streamed: the choice's first chunk)
    token_ids: list[int] | None = None  # vLLM's, with return_token_ids (streamed: the chunk's)


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"]
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None
