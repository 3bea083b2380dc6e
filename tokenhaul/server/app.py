"""The HTTP face: the FastAPI app — OpenAI routes (completions, chat, models), vLLM's /tokenize, /detokenize,
/ping and /version, /health, /metrics, and the error handlers that turn every refusal into an OpenAI error body."""

from __future__ import annotations

import asyncio
import dataclasses
import importlib.metadata
import json
import logging
import signal
import threading
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from fastapi.routing import APIRoute
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.middleware.cors import CORSMiddleware

from tokenhaul.errors import TokenhaulError
from tokenhaul.server.async_engine import AsyncEngine
from tokenhaul.server.chat import ChatHandler
from tokenhaul.server.chat_protocol import ChatCompletionRequest, ChatCompletionResponse
from tokenhaul.server.completion_protocol import CompletionRequest, CompletionResponse
from tokenhaul.server.completions import CompletionsHandler
from tokenhaul.server.errors import APIError, ClientGone, unknown_model
from tokenhaul.server.guards import LOOPBACK_HOSTS, Guard, ServerOptions
from tokenhaul.server.http_protocol import uvicorn_config
from tokenhaul.server.metrics import CONTENT_TYPE
from tokenhaul.server.protocol import ErrorResponse, ModelCard, ModelList
from tokenhaul.server.tokenization import TokenizationHandlers
from tokenhaul.server.tokenize_protocol import (
    DetokenizeRequest,
    DetokenizeResponse,
    TokenizeRequest,
    TokenizeResponse,
)

_ERRORS: dict[int | str, dict[str, Any]] = {
    400: {"model": ErrorResponse, "description": "Invalid request"},
    401: {"model": ErrorResponse, "description": "Missing or invalid API key"},
    404: {"model": ErrorResponse, "description": "Unknown model"},
    413: {"model": ErrorResponse, "description": "Request body too large"},
    429: {"model": ErrorResponse, "description": "Waiting queue full; retry later"},
    503: {"model": ErrorResponse, "description": "Engine not running"},
}
log = logging.getLogger("tokenhaul.server")


def _version() -> str:
    try:
        return importlib.metadata.version("tokenhaul")
    except importlib.metadata.PackageNotFoundError:  # run from a source tree that is not installed
        return "0.0.0+unknown"


VERSION = _version()  # GET /version (vLLM's) and the OpenAPI document's


class _OffLoopJSONRequest(Request):
    """A request whose JSON body is parsed in a worker thread (a 2 MB body of small objects takes
    ~0.1 s to parse, which must not stall every other request on the event loop) and refused if it
    is not strict JSON: NaN / Infinity literals, or a string holding a lone UTF-16 surrogate
    ("\\ud800" is valid JSON but no text can be made of it)."""

    async def json(self) -> Any:
        if not hasattr(self, "_json"):
            self._json = await asyncio.to_thread(_parse_json, await self.body())
        return self._json


def _parse_json(body: bytes) -> Any:
    obj = json.loads(body, parse_constant=_no_constant)
    if b"\\u" in body or not body.isascii():  # only an escape or raw bytes can carry a surrogate
        try:
            json.dumps(obj, ensure_ascii=False).encode()
        except UnicodeEncodeError:
            raise json.JSONDecodeError("a string holds a lone UTF-16 surrogate (invalid Unicode)", "", 0) from None
    return obj


def _no_constant(name: str) -> Any:
    """Python's json takes NaN, Infinity and -Infinity; JSON has no such literals."""
    raise json.JSONDecodeError(f"{name} is not a JSON value", "", 0)


class _Route(APIRoute):
    def get_route_handler(self):  # noqa: ANN201 (starlette's handler type)
        handler = super().get_route_handler()

        async def route(request: Request) -> Response:
            return await handler(_OffLoopJSONRequest(request.scope, request.receive))

        return route


def build_app(engine: AsyncEngine, options: ServerOptions | None = None, manage_engine: bool = True,
              start_core: bool = True) -> FastAPI:
    """The ASGI app over one engine, guarded by `options` (key, hosts, origins, body limit); with
    manage_engine the app's lifespan starts and stops the engine (and, with start_core, starts the
    core's step loop in a thread of its own)."""
    options = options or ServerOptions()

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        if manage_engine:
            await engine.start(start_core)
        try:
            yield
        finally:
            if manage_engine:
                await engine.shutdown()

    docs = {} if options.docs else {"docs_url": None, "redoc_url": None, "openapi_url": None}
    app = FastAPI(title="tokenhaul", version=VERSION, lifespan=lifespan, **docs,
                  description="OpenAI-compatible completions and chat over the tokenhaul engine.")
    app.router.route_class = _Route
    app.state.engine = engine
    app.add_middleware(Guard, options=options)
    if options.allowed_origins:  # outermost: preflights are answered before the key is asked for
        app.add_middleware(CORSMiddleware, allow_origins=list(options.allowed_origins),
                           allow_methods=["GET", "POST"], allow_headers=["authorization", "content-type"])
    completion_api = CompletionsHandler(engine)
    chat_api = ChatHandler(engine, options.tool_call_parser if options.enable_auto_tool_choice else None,
                           options.exclude_tools_when_tool_choice_none)
    tok = TokenizationHandlers(engine)

    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError) -> JSONResponse:
        return exc.response()

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
        engine.metrics.rejected.labels("invalid").inc()
        return _validation_error(exc).response()

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        return APIError(exc.status_code, f"{exc.detail}: {request.method} {request.url.path}", kind,
                        headers=getattr(exc, "headers", None)).response()

    @app.exception_handler(ClientGone)
    async def _gone(request: Request, exc: ClientGone) -> Response:
        return Response(status_code=499)  # nobody reads it: the client has gone

    def check_healthy() -> None:
        if not engine.healthy:
            raise APIError(503, "the engine is not running", "service_unavailable", code="engine_unavailable")

    @app.api_route("/health", methods=["GET", "HEAD"], responses={503: _ERRORS[503]})
    async def health() -> dict[str, Any]:
        """200 while some replica takes requests, with each replica's state; 503 when none does (HEAD: no body)."""
        check_healthy()
        reps = {r.name: {"status": "ok" if r.up else "down", "where": r.where, "running": r.stats.num_running,
                         "waiting": r.stats.num_waiting, "kv_blocks_used": r.stats.kv_blocks_used,
                         "kv_blocks_total": r.stats.kv_blocks_total} for r in engine.client.replicas()}
        return {"status": "ok", "replicas": reps}

    @app.api_route("/ping", methods=["GET", "POST", "HEAD"], response_class=Response,
                   responses={200: {"description": "the engine takes requests (no body)"}, 503: _ERRORS[503]})
    async def ping() -> Response:
        """vLLM's (SageMaker's) health probe: 200 with no body while the engine takes requests, else 503."""
        check_healthy()
        return Response(status_code=200)

    @app.get("/version")
    async def version() -> dict[str, str]:
        """vLLM's: the server's version (tokenhaul's)."""
        return {"version": VERSION}

    @app.api_route("/metrics", methods=["GET", "HEAD"], response_class=Response,
             responses={200: {"content": {"text/plain": {"schema": {"type": "string"}}}}})
    async def metrics() -> Response:
        return Response(engine.metrics.render(), media_type=CONTENT_TYPE)

    @app.get("/ledger", responses={400: _ERRORS[400]})
    async def ledger(since: int | None = None) -> dict[str, Any]:
        """Every engine replica's ledger, gathered now: totals since start, what its prefix-cache misses
        cost, and (with `since`) its step records after that step index, each naming its replica."""
        reps = await engine.client.ledgers(since)
        for name, snap in reps.items():
            for rec in snap.get("step_records", ()):
                rec["replica"] = name
        return {"replicas": reps, "routing": engine.client.routing()}

    def card() -> dict:
        return {"id": engine.model_name, "object": "model", "created": engine.created, "owned_by": "tokenhaul",
                "max_model_len": engine.limits.max_model_len}

    @app.get("/v1/models", response_model=ModelList)
    async def models() -> dict:
        return {"object": "list", "data": [card()]}

    @app.get("/v1/models/{model:path}", response_model=ModelCard, responses={404: _ERRORS[404]})
    async def model(model: str) -> dict:
        """The served model's card, as /v1/models lists it (a name may hold '/'); 404 for any other name."""
        if model != engine.model_name:
            raise unknown_model(engine, model)
        return card()

    event = {"type": "object", "required": ["data"], "properties": {"data": {
        "type": "string", "description": "one JSON chunk (a completion chunk or an error), or [DONE]"}}}
    stream_doc = {"text/event-stream": {"schema": event}}  # OpenAPI < 3.2: `schema` describes one event

    @app.post("/v1/completions", response_model=None,
              responses={200: {"model": CompletionResponse, "content": stream_doc}, **_ERRORS})
    async def completions(body: CompletionRequest, request: Request) -> Response:
        return await completion_api.completions(body, request)

    @app.post("/v1/chat/completions", response_model=None,
              responses={200: {"model": ChatCompletionResponse, "content": stream_doc}, **_ERRORS})
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
        return await chat_api.chat(body, request)

    tok_errors = {k: _ERRORS[k] for k in (400, 401, 404, 413)}

    @app.post("/tokenize", response_model=TokenizeResponse, responses=tok_errors)
    async def tokenize(body: TokenizeRequest) -> dict:
        """vLLM's: the token ids of a `prompt`, or of `messages` rendered as /v1/chat/completions renders them."""
        return await tok.tokenize(body)

    @app.post("/detokenize", response_model=DetokenizeResponse, responses=tok_errors)
    async def detokenize(body: DetokenizeRequest) -> dict:
        """vLLM's: the text of token ids."""
        return await tok.detokenize(body)

    return app


def _validation_error(exc: RequestValidationError) -> APIError:
    """pydantic's errors → one 400: the field named as the client wrote it (a union's branch tags dropped), and
    what is wrong with it; where its value fit one branch's type, that branch's complaint (a list too long), else
    what any branch would have taken."""
    errors = list(exc.errors())
    if not errors:
        return APIError(400, "invalid request body")
    if errors[0].get("type") == "json_invalid":
        why = (errors[0].get("ctx") or {}).get("error", "malformed")
        return APIError(400, f"request body is not valid JSON: {why}", code="invalid_json")
    paths = [".".join(str(x) for x in e.get("loc", ()) if x != "body" and not _union_branch(x)) for e in errors]

    def mismatch(i: int) -> bool:
        return str(errors[i].get("type", "")).endswith("_type")

    best = min(range(len(errors)), key=lambda i: (mismatch(i), -paths[i].count(".")))
    e, param = errors[best], paths[best] or None
    msg = str(e.get("msg", "invalid"))
    if mismatch(best):  # no branch took the value's type: say what each would have taken
        wants = dict.fromkeys(str(errors[i].get("msg", "")).removeprefix("Input should be ")
                              for i in range(len(errors)) if paths[i] == paths[best] and mismatch(i))
        msg = "Input should be " + " or ".join(w for w in wants if w) if len(wants) > 1 else msg
    others = len(set(paths) - {paths[best]})
    more = f" (and {others} more error{'s' if others > 1 else ''})" if others else ""
    return APIError(400, f"{param or 'body'}: {msg}{more}", param=param, code=e.get("type"))


def _union_branch(part: object) -> bool:
    """A location part naming a union's branch ('str', 'list[int]', 'constrained-str'), not a field or index."""
    return isinstance(part, str) and (part in ("str", "int", "float", "bool", "list", "dict") or "[" in part
                                      or "-" in part)


def serve(engine: AsyncEngine, host: str = "127.0.0.1", port: int = 8000, log_level: str = "info",
          access_log: bool = False, shutdown_timeout: float = 30.0, options: ServerOptions | None = None) -> None:
    """Serve until SIGTERM / SIGINT (blocking): uvicorn's event loop in a background thread, the
    client's `run()` in this thread — for an in-process core its step loop, here in the thread that
    loaded the model, where CPU steps run ~15 % faster than in a fresh thread (measured on
    smollm2-135m, 2 threads: 30 vs 34.6 ms/step); for Ray replicas a wait.

    The first signal drains: new requests get 503 while the ones in flight finish (for at most
    `shutdown_timeout` seconds), then the process returns normally. A second signal stops at once
    (KeyboardInterrupt). If the engine loop dies, this raises EngineDied: a supervisor sees a failure.
    Bound to loopback without `options.allowed_hosts`, only loopback Host headers are answered (a web
    page cannot reach the server by DNS rebinding)."""
    import uvicorn

    options = options or ServerOptions()
    if options.allowed_hosts is None and host in LOOPBACK_HOSTS:
        options = dataclasses.replace(options, allowed_hosts=LOOPBACK_HOSTS)
    config = uvicorn_config(build_app(engine, options, start_core=False), options, host=host, port=port,
                            log_level=log_level, access_log=access_log, timeout_graceful_shutdown=5)
    server = uvicorn.Server(config)
    draining = threading.Event()

    def run_http() -> None:
        try:
            server.run()
        finally:  # however uvicorn stops, the client stops too (and with it run() below)
            engine.client.close()

    async def drain_then_exit() -> None:
        finished = await engine.drain(shutdown_timeout)
        log.info("drained: %s; stopping the HTTP server", "every request finished" if finished
                 else f"requests still running after {shutdown_timeout:g} s were failed")
        server.should_exit = True

    def on_signal(signum: int, frame: object) -> None:
        if draining.is_set():
            raise KeyboardInterrupt  # the second signal: stop now
        draining.set()
        log.warning("%s: draining (new requests get 503; up to %g s for those in flight)",
                    signal.Signals(signum).name, shutdown_timeout)
        loop = engine.loop
        if loop is None or loop.is_closed():
            server.should_exit = True
        else:
            asyncio.run_coroutine_threadsafe(drain_then_exit(), loop)

    http = threading.Thread(target=run_http, name="tokenhaul-http", daemon=True)
    previous = {sig: signal.signal(sig, on_signal) for sig in (signal.SIGINT, signal.SIGTERM)}
    http.start()
    try:
        engine.client.run()  # returns at shutdown, or when an in-process loop dies (client.error)
    finally:
        server.should_exit = True
        error = engine.client.error
        if error is not None:
            server.force_exit = isinstance(error, KeyboardInterrupt)
        http.join(shutdown_timeout + 10)
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    if isinstance(error, KeyboardInterrupt):
        raise KeyboardInterrupt
    if error is not None:
        raise EngineDied(f"the engine loop died ({type(error).__name__}: {error}); see the log above")
    if not server.started:
        raise TokenhaulError(f"the HTTP server did not start on {host}:{port} (see the log above)")


class EngineDied(TokenhaulError):
    """The engine's step loop died: the process must exit with a failure status."""
