"""The server's refusals as OpenAI error bodies: APIError (HTTP status + {"error": {...}}), the engine's exceptions
mapped to it, and the checks every endpoint shares (the model's name; a request refused while it is read)."""

from __future__ import annotations

from fastapi.responses import JSONResponse

from tokenhaul.errors import CapacityError, RequestError, TokenhaulError
from tokenhaul.server.async_engine import (
    AsyncEngine,
    EngineFailed,
    EngineOverloaded,
    EngineUnavailable,
    PromptTooLong,
)
from tokenhaul.server.chat_protocol import ChatCompletionRequest
from tokenhaul.server.completion_protocol import CompletionRequest

# a RequestError whose first word is one of these names the field it is about (the 400's param)
_FIELDS = (set(ChatCompletionRequest.model_fields) | set(CompletionRequest.model_fields)
           | set(ChatCompletionRequest.refused_extras) | set(CompletionRequest.refused_extras))


class APIError(Exception):
    """An HTTP error with an OpenAI error body: {"error": {"message", "type", "param", "code"}}."""

    def __init__(self, status: int, message: str, type: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None, headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code
        self.headers = headers

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)


class ClientGone(Exception):
    """The client disconnected before a non-streamed response was ready; its requests are aborted."""


def api_error(e: TokenhaulError, prompt_param: str = "prompt") -> APIError:
    """Engine-side exception → HTTP status and OpenAI error body."""
    msg = str(e)
    if isinstance(e, EngineOverloaded):
        return APIError(429, msg, "rate_limit_error", code="queue_full", headers={"Retry-After": "1"})
    if isinstance(e, EngineUnavailable):
        return APIError(503, msg, "service_unavailable", code="engine_unavailable")
    if isinstance(e, EngineFailed):
        return APIError(500, msg, "server_error", code="engine_error")
    if isinstance(e, PromptTooLong):
        return APIError(400, msg, param=prompt_param, code="context_length_exceeded")
    if isinstance(e, CapacityError):
        return APIError(400, msg, param="max_tokens", code="kv_capacity_exceeded")
    if isinstance(e, RequestError):
        first = msg.split(" ", 1)[0].removesuffix(":")  # "field: ..." names it too
        return APIError(400, msg, param=first if first in _FIELDS else None)
    return APIError(500, msg, "server_error")


def unknown_model(engine: AsyncEngine, model: str) -> APIError:
    """404 for a model name this server does not serve (OpenAI's code model_not_found)."""
    return APIError(404, f"model '{model}' does not exist; this server serves '{engine.model_name}'",
                    param="model", code="model_not_found")


def check_model(engine: AsyncEngine, model: str | None) -> None:
    """The served model's name, or none (null or "", as vLLM: the served model); else 404, counted as rejected."""
    if model and model != engine.model_name:
        engine.metrics.rejected.labels("model_not_found").inc()
        raise unknown_model(engine, model)


def refused(engine: AsyncEngine, e: TokenhaulError, prompt_param: str = "prompt") -> APIError:
    """A request refused while it is read (sampling parameters, prompt), counted as rejected."""
    engine.metrics.rejected.labels("invalid").inc()
    return api_error(e, prompt_param)
