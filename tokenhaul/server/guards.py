"""What stands between the network and the API: the server's options (key, hosts, origins, limits,
timeouts) and the ASGI middleware that enforces them before any route runs — Host check, API key,
body size and read deadline — and turns an unexpected exception into a generic 500 with an error id."""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import uuid
from collections.abc import Awaitable, Callable, MutableMapping
from dataclasses import dataclass
from typing import Any

from starlette.datastructures import Headers

log = logging.getLogger("tokenhaul.server")
Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]

OPEN_PATHS = frozenset({"/health", "/ping"})  # answered without an API key (liveness probes; /ping is vLLM's)
LOOPBACK_HOSTS = ("localhost", "127.0.0.1", "::1")


@dataclass(frozen=True)
class ServerOptions:
    """How the HTTP server faces its clients; the defaults suit a server bound to loopback."""

    api_key: str | None = None  # clients send `Authorization: Bearer <key>`; None: no authentication
    allowed_hosts: tuple[str, ...] | None = None  # Host header values (no port; "*.x.org" ok); None: any
    allowed_origins: tuple[str, ...] = ()  # CORS: browser origins allowed to call the API; none by default
    docs: bool = True  # serve /docs and /openapi.json
    max_body_bytes: int = 2 * 2**20
    header_timeout: float = 10.0  # a connection must send a full request head within this
    body_timeout: float = 30.0  # ... and then its full body within this
    keep_alive_timeout: float = 5.0  # an idle keep-alive connection is closed after this
    enable_auto_tool_choice: bool = False  # vLLM's: serve chat tool_choice "auto" (the default with tools)
    tool_call_parser: str | None = None  # ... reading the calls from the text with this parser (tools.PARSERS)
    exclude_tools_when_tool_choice_none: bool = False  # vLLM's: tool_choice "none" leaves the tools out of the prompt

    def __post_init__(self) -> None:
        from tokenhaul.errors import TokenhaulError

        if self.api_key is not None and not self.api_key.strip():
            raise TokenhaulError("the API key is empty")
        if min(self.max_body_bytes, self.header_timeout, self.body_timeout, self.keep_alive_timeout) <= 0:
            raise TokenhaulError("body size limit and timeouts must be positive")
        from tokenhaul.server.tools import PARSERS

        if self.tool_call_parser is not None and self.tool_call_parser not in PARSERS:
            raise TokenhaulError(f"--tool-call-parser {self.tool_call_parser}: one of {', '.join(PARSERS)}")
        if self.enable_auto_tool_choice and self.tool_call_parser is None:
            raise TokenhaulError("--enable-auto-tool-choice needs --tool-call-parser")


class Guard:
    """ASGI middleware enforcing ServerOptions on every HTTP request."""

    def __init__(self, app: ASGIApp, options: ServerOptions) -> None:
        self.app = app
        self.options = options
        self._key = options.api_key.encode() if options.api_key else None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        o, headers = self.options, Headers(scope=scope)
        if o.allowed_hosts is not None and not host_allowed(headers.get("host", ""), o.allowed_hosts):
            return await reply(send, 400, "the Host header names no host this server answers for",
                               code="invalid_host", close=True)
        if self._key is not None and scope["path"] not in OPEN_PATHS and not self._authorized(headers):
            return await reply(send, 401, "missing or invalid API key: send the header 'Authorization: Bearer "
                               "<key>'", code="invalid_api_key", headers={"www-authenticate": "Bearer"})
        if scope["method"] in ("POST", "PUT", "PATCH"):
            length = headers.get("content-length")
            if length is not None and (not length.isdigit() or int(length) > o.max_body_bytes):
                return await self._too_large(receive, send)
            try:
                body = await asyncio.wait_for(_read_body(receive, o.max_body_bytes), o.body_timeout)
            except TimeoutError:
                return await reply(send, 408, f"the request body did not arrive within {o.body_timeout:g} s",
                                   code="request_timeout", close=True)
            except _BodyTooLarge:
                return await self._too_large(receive, send)
            except _ClientGone:
                return None
            receive = _replay(body, receive)
        started = False

        async def tracked(message: Message) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, receive, tracked)
        except Exception:
            if started:  # too late for a status line: uvicorn logs it and closes the connection
                raise
            error_id = uuid.uuid4().hex[:12]
            log.exception("unexpected error %s in %s %s", error_id, scope["method"], scope["path"])
            await reply(send, 500, f"internal error (error id {error_id}); the server log has the details",
                        "server_error")

    def _authorized(self, headers: Headers) -> bool:
        scheme, _, token = headers.get("authorization", "").partition(" ")
        return scheme.lower() == "bearer" and hmac.compare_digest(token.strip().encode(), self._key or b"")

    async def _too_large(self, receive: Receive, send: Send) -> None:
        """413, after reading and dropping what the client still sends (a bounded lingering close): closing a
        socket with unread data resets it, and the client would lose the reply mid-upload."""
        o = self.options
        try:
            await asyncio.wait_for(_discard_body(receive, DISCARD_FACTOR * o.max_body_bytes), min(o.body_timeout, 5.0))
        except (TimeoutError, _BodyTooLarge, _ClientGone):
            pass
        await reply(send, 413, f"the request body is larger than {self.options.max_body_bytes} bytes",
                    code="body_too_large", close=True)


def host_allowed(host_header: str, allowed: tuple[str, ...]) -> bool:
    """The Host header's name (port stripped) against names; "*" and "*.domain" match as wildcards."""
    host = _hostname(host_header)
    return any(a == "*" or a.lower() == host or (a.startswith("*.") and host.endswith(a[1:].lower()))
               for a in allowed)


def _hostname(host_header: str) -> str:
    h = host_header.strip().lower()
    if h.startswith("["):  # [::1]:8000
        return h[1:].partition("]")[0]
    return h.partition(":")[0] if h.count(":") == 1 else h


async def reply(send: Send, status: int, message: str, type: str = "invalid_request_error", code: str | None = None,
                headers: dict[str, str] | None = None, close: bool = False) -> None:
    """Send a whole JSON response with an OpenAI error body (close: ask the client to reconnect)."""
    body = json.dumps({"error": {"message": message, "type": type, "param": None, "code": code}}).encode()
    raw = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    raw += [(k.encode(), v.encode()) for k, v in (headers or {}).items()]
    if close:
        raw.append((b"connection", b"close"))
    await send({"type": "http.response.start", "status": status, "headers": raw})
    await send({"type": "http.response.body", "body": body})


DISCARD_FACTOR = 32  # an oversized body is read and dropped up to 32x the limit before the 413 (then: reset)


class _BodyTooLarge(Exception):
    pass


class _ClientGone(Exception):
    pass


async def _read_body(receive: Receive, limit: int) -> bytes:
    chunks, n = [], 0
    while True:
        m = await receive()
        if m["type"] == "http.disconnect":
            raise _ClientGone
        b = m.get("body", b"")
        n += len(b)
        if n > limit:
            raise _BodyTooLarge
        chunks.append(b)
        if not m.get("more_body", False):
            return b"".join(chunks)


async def _discard_body(receive: Receive, limit: int) -> None:
    n = 0
    while True:
        m = await receive()
        if m["type"] == "http.disconnect":
            raise _ClientGone
        n += len(m.get("body", b""))
        if n > limit:
            raise _BodyTooLarge
        if not m.get("more_body", False):
            return


def _replay(body: bytes, receive: Receive) -> Receive:
    """A receive() that hands out the body already read, then waits on the real one (disconnects)."""
    pending = True

    async def replayed() -> Message:
        nonlocal pending
        if pending:
            pending = False
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return replayed
