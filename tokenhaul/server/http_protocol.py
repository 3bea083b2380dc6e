"""uvicorn's h11 protocol with a deadline on the request head: a connection that opens and sends
nothing, or sends a head slowly, is closed after `header_timeout` (uvicorn only times idle keep-alive).
On shutdown, connections still sending a request are closed at once instead of being waited for."""

from __future__ import annotations

import asyncio

import h11
import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol

from tokenhaul.server.guards import ServerOptions


class TimedH11Protocol(H11Protocol):
    header_timeout: float = 10.0
    _head_timer: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._arm()

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        if self.conn.their_state is h11.IDLE:  # a head begun but not complete: its deadline runs
            self._arm()
        else:
            self._disarm()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        super().connection_lost(exc)

    def shutdown(self) -> None:
        if self.conn.their_state is h11.SEND_BODY and not (self.cycle and self.cycle.response_started):
            self.transport.close()  # a request still arriving will never be served now
            return
        super().shutdown()

    def _arm(self) -> None:
        if self._head_timer is None:
            self._head_timer = self.loop.call_later(self.header_timeout, self._head_timeout)

    def _disarm(self) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None

    def _head_timeout(self) -> None:
        self._head_timer = None
        if self.conn.their_state is h11.IDLE and not self.transport.is_closing():
            self.transport.close()


def uvicorn_config(app, options: ServerOptions, **kwargs) -> uvicorn.Config:
    """uvicorn settings for `app` under `options` (timeouts), plus any uvicorn.Config keyword."""
    protocol = type("TimedH11", (TimedH11Protocol,), {"header_timeout": options.header_timeout})
    return uvicorn.Config(app, http=protocol, timeout_keep_alive=options.keep_alive_timeout,  # type: ignore[arg-type]
                          **kwargs)
