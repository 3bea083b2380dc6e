"""The x-tokenhaul-replica header names the replica that served the call, also when the request was retried on
another one before it streamed (as ReplicaPool does when a replica dies): here a scripted core whose client says
each request went to replica 0, then moves it to replica 1."""

from __future__ import annotations

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
