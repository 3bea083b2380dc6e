"""The x-tokenhaul-replica header names the replica that served the call, also when the request was retried on
another one before it streamed (as ReplicaPool does when a replica dies): here a scripted core whose client says
each request went to replica 0, then moves it to replica 1. A client that never moves requests (one in-process
core) sends an SSE response's headers and chat role chunk at once, before any token."""

from __future__ import annotations

import json
import threading

import httpx
import pytest
from serverkit import ServerThread, script_engine

from tokenhaul.engine.client import InProcessClient
from tokenhaul.engine.messages import AddRequest
from tokenhaul.server.app import build_app
from tokenhaul.server.async_engine import AsyncEngine


class MovingClient(InProcessClient):
    """Sends every request to "0", then (before the core can answer) moves it to "1", through the front end's
    `on_moved` hook."""

    moves_requests = True
    on_moved = None

    def add(self, msg: AddRequest) -> str:
        super().add(msg)
        if self.on_moved is not None:  # None: a front end that does not listen
            self._loop.call_soon(self.on_moved, msg.request_id, "1")
        return "0"


@pytest.mark.parametrize("stream", [False, True], ids=["json", "stream"])
def test_replica_header_names_the_replica_a_retried_request_ran_on(tokenizer, stream):
    core = script_engine(tokenizer)[0].client.core_thread.core
    engine = AsyncEngine(MovingClient(core), tokenizer, "script-model")
    with ServerThread(build_app(engine)) as srv:
        body = {"model": "script-model", "prompt": "Hello there", "max_tokens": 4, "stream": stream}
        with httpx.Client(timeout=60) as c, c.stream("POST", srv.url + "/v1/completions", json=body) as r:
            r.read()
            assert r.status_code == 200 and r.headers["x-tokenhaul-replica"] == "1"


class HeldClient(InProcessClient):
    """Holds every request from the core until `release()`: no token comes before then."""

    def __init__(self, *args, **kw) -> None:
        super().__init__(*args, **kw)
        self.held: list[AddRequest] = []
        self.lock = threading.Lock()

    def add(self, msg: AddRequest) -> str:
        with self.lock:
            self.held.append(msg)
        return self.NAME

    def release(self) -> None:
        with self.lock:
            for msg in self.held:
                self.core_thread.add(msg)
            self.held.clear()


def test_a_stream_that_cannot_move_sends_headers_and_role_chunk_before_any_token(tokenizer):
    client = HeldClient(script_engine(tokenizer)[0].client.core_thread.core)
    engine = AsyncEngine(client, tokenizer, "script-model")
    body = {"model": "script-model", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4,
            "stream": True}
    with ServerThread(build_app(engine)) as srv, httpx.Client(timeout=10) as c, \
            c.stream("POST", srv.url + "/v1/chat/completions", json=body) as r:
        assert r.status_code == 200 and r.headers["x-tokenhaul-replica"] == "0"
        lines = r.iter_lines()
        role = json.loads(next(line for line in lines if line)[len("data: "):])
        assert role["choices"][0]["delta"] == {"role": "assistant", "content": ""} and client.held
        client.release()
        rest = [line for line in lines if line]
        assert rest[-1] == "data: [DONE]" and json.loads(rest[-2][len("data: "):])["choices"][0]["finish_reason"]
