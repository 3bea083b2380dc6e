"""The server faced as a hostile client would: API key, Host, CORS and docs; body, prompt and list
limits enforced before any heavy work, text work off the event loop; invalid Unicode; idle and
half-sent connections; a generation deadline. Runs over the scripted model (fast)."""

from __future__ import annotations

import contextlib
import json
import selectors
import socket
import threading
import time
from collections.abc import Iterator

import httpx
import pytest
from serverkit import ServerThread, script_engine, wait_idle

from tokenhaul.server.app import build_app
from tokenhaul.server.guards import ServerOptions, host_allowed
from tokenhaul.server.protocol import MAX_MESSAGES, MAX_STOP_CHARS, MAX_STOP_TOKEN_IDS

CMPL, CHAT = "/v1/completions", "/v1/chat/completions"
KEY = "sk-test-4c1d"


@contextlib.contextmanager
def server(tokenizer, **options) -> Iterator[tuple[str, object, ServerThread]]:
    engine, model = script_engine(tokenizer)
    with ServerThread(build_app(engine, ServerOptions(**options)), ServerOptions(**options)) as srv:
        yield srv.url, engine, srv


class TextSpy:
    """Wraps the tokenizer's encode / apply_chat_template to record which threads ran them."""

    def __init__(self, tokenizer) -> None:
        self.calls: list[tuple[str, threading.Thread, int]] = []
        for name in ("encode", "apply_chat_template"):
            real = getattr(tokenizer, name)

            def spy(arg, *a, _real=real, _name=name, **kw):
                self.calls.append((_name, threading.current_thread(), len(arg)))
                return _real(arg, *a, **kw)

            setattr(tokenizer, name, spy)


def test_api_key_guards_everything_but_health(tokenizer):
    with server(tokenizer, api_key=KEY) as (url, _, _), httpx.Client(timeout=30) as c:
        body = {"prompt": "Hi", "max_tokens": 2}
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY}, {"Authorization": "Basic x"}):
            r = c.post(url + CMPL, json=body, headers=headers)
            assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key", headers
        for path in ("/docs", "/openapi.json", "/metrics", "/v1/models"):
            assert c.get(url + path).status_code == 401, path
            assert c.get(url + path, headers={"Authorization": f"Bearer {KEY}"}).status_code == 200, path
        assert c.get(url + "/health").status_code == 200
        r = c.post(url + CMPL, json=body, headers={"Authorization": f"Bearer {KEY}"})
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 2


def test_docs_can_be_hidden(tokenizer):
    with server(tokenizer, docs=False) as (url, _, _), httpx.Client(timeout=30) as c:
        assert c.get(url + "/docs").status_code == 404 and c.get(url + "/openapi.json").status_code == 404
        assert c.get(url + "/health").status_code == 200


def test_host_header_must_name_an_allowed_host(tokenizer):
    with server(tokenizer, allowed_hosts=("localhost", "127.0.0.1")) as (url, _, _), httpx.Client(timeout=30) as c:
        r = c.get(url + "/v1/models", headers={"Host": "evil.example"})
        assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_host"
        assert c.get(url + "/v1/models").status_code == 200  # Host: 127.0.0.1:<port>
    assert host_allowed("[::1]:8000", ("::1",)) and host_allowed("LOCALHOST:1", ("localhost",))
    assert host_allowed("a.b.example.org", ("*.example.org",)) and not host_allowed("example.org.evil", ("*.org",))
    assert not host_allowed("127.0.0.1.nip.io", ("127.0.0.1",))


def test_cors_is_off_unless_origins_are_allowed(tokenizer):
    pre = {"Origin": "https://evil.example", "Access-Control-Request-Method": "POST"}
    with server(tokenizer) as (url, _, _), httpx.Client(timeout=30) as c:
        assert "access-control-allow-origin" not in c.get(url + "/v1/models", headers={"Origin": pre["Origin"]}).headers
        assert "access-control-allow-origin" not in c.options(url + CMPL, headers=pre).headers
    with server(tokenizer, allowed_origins=("https://ok.example",), api_key=KEY) as (url, _, _), \
            httpx.Client(timeout=30) as c:
        ok = c.options(url + CMPL, headers=pre | {"Origin": "https://ok.example"})
        assert ok.status_code == 200 and ok.headers["access-control-allow-origin"] == "https://ok.example"
        assert "access-control-allow-origin" not in c.options(url + CMPL, headers=pre).headers


def test_large_bodies_get_413_before_being_read(tokenizer):
    with server(tokenizer, max_body_bytes=1 << 20) as (url, _, _), httpx.Client(timeout=60) as c:
        big = json.dumps({"prompt": "x" * (20 << 20)}).encode()
        r = c.post(url + CMPL, content=big, headers={"Content-Type": "application/json"})
        assert r.status_code == 413 and r.json()["error"]["code"] == "body_too_large"

        def chunks():  # no Content-Length: counted while it arrives
            yield b'{"prompt": "'
            for _ in range(40):
                yield b"y" * 65536
            yield b'"}'

        r = c.post(url + CMPL, content=chunks(), headers={"Content-Type": "application/json"})
        assert r.status_code == 413
        assert c.post(url + CMPL, json={"prompt": "Hi", "max_tokens": 1}).status_code == 200


def test_long_prompts_and_many_messages_are_refused_before_tokenizing(tokenizer):
    with server(tokenizer) as (url, engine, _), httpx.Client(timeout=60) as c:
        spy = TextSpy(engine.tokenizer)
        r = c.post(url + CMPL, json={"prompt": "a" * 2_000_000})
        assert r.status_code == 400 and "characters" in r.json()["error"]["message"]
        r = c.post(url + CHAT, json={"messages": [{"role": "user", "content": "hé " * 50_000}]})
        assert r.status_code == 400 and "characters" in r.json()["error"]["message"]
        r = c.post(url + CHAT, json={"messages": [{"role": "user", "content": "hi"}] * (MAX_MESSAGES + 1)})
        assert r.status_code == 400 and str(MAX_MESSAGES) in r.json()["error"]["message"]
        assert spy.calls == []  # nothing was tokenized or templated


def test_text_work_runs_off_the_event_loop(tokenizer):
    with server(tokenizer) as (url, engine, srv), httpx.Client(timeout=60) as c:
        spy = TextSpy(engine.tokenizer)
        assert c.post(url + CMPL, json={"prompt": "Hi there", "max_tokens": 1}).status_code == 200
        assert c.post(url + CHAT, json={"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 1}
                      ).status_code == 200
        assert {name for name, _, _ in spy.calls} == {"encode", "apply_chat_template"}
        assert all(t is not srv.thread for _, t, _ in spy.calls)  # uvicorn's loop runs in srv.thread


def raw_requests(url: str, bodies: list[bytes], path: str = CMPL) -> list[tuple[int, bytes]]:
    """Send the bodies one after another on ONE keep-alive connection; (status, body) of each."""
    host, port = url.removeprefix("http://").split(":")
    out = []
    with socket.create_connection((host, int(port)), timeout=30) as s:
        f = s.makefile("rb")
        for body in bodies:
            s.sendall(b"POST %s HTTP/1.1\r\nHost: %s\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n"
                      % (path.encode(), host.encode(), len(body)) + body)
            status = int(f.readline().split()[1])
            length = 0
            while (line := f.readline()) not in (b"\r\n", b""):
                name, _, value = line.decode().partition(":")
                if name.lower() == "content-length":
                    length = int(value)
            out.append((status, f.read(length)))
    return out


@pytest.mark.parametrize("path,bad", [
    (CMPL, rb'{"prompt": "abc\ud800"}'),
    (CMPL, rb'{"prompt": ["ok", "\udfff x"]}'),
    (CMPL, rb'{"prompt": "Hi", "model": "m\ud800"}'),
    (CMPL, rb'{"prompt": "Hi", "stop": ["\ud83d"]}'),
    (CHAT, rb'{"messages": [{"role": "user", "content": "abc\ud800"}]}'),
    (CHAT, rb'{"messages": [{"role": "user", "content": [{"type": "text", "text": "\udc00"}]}]}'),
])
def test_lone_surrogates_get_400_and_the_connection_lives(tokenizer, script_server, path, bad):
    url, _, _ = script_server
    good = (b'{"prompt": "Hi \\ud83d\\ude00", "max_tokens": 1}' if path == CMPL
            else b'{"messages": [{"role": "user", "content": "\\ud83d\\ude00"}], "max_tokens": 1}')
    (s1, b1), (s2, _) = raw_requests(url, [bad, good], path)  # the same connection, kept alive
    assert s1 == 400 and "surrogate" in json.loads(b1)["error"]["message"]
    assert s2 == 200  # a valid pair (an emoji) is fine


def test_stop_lists_are_capped(tokenizer, script_server):
    url, _, _ = script_server
    with httpx.Client(timeout=60) as c:
        for extra, param in (({"stop_token_ids": list(range(MAX_STOP_TOKEN_IDS + 1))}, "stop_token_ids"),
                             ({"stop": ["x" * (MAX_STOP_CHARS + 1)]}, "stop"),
                             ({"stop": "x" * (MAX_STOP_CHARS + 1)}, "stop"),
                             ({"stop": [str(i) for i in range(17)]}, "stop")):
            r = c.post(url + CMPL, json={"prompt": "Hi"} | extra)
            assert r.status_code == 400 and r.json()["error"]["param"].startswith(param), (extra.keys(), r.text)
        r = c.post(url + CMPL, json={"prompt": "Hi", "stop_token_ids": list(range(1_000_000))})
        assert r.status_code == 413
        r = c.post(url + CMPL, json={"prompt": "Hi", "stop": ["y" * (1 << 20)] * 16})
        assert r.status_code == 413


def test_idle_and_half_sent_connections_are_closed(tokenizer):
    opts = dict(header_timeout=0.5, body_timeout=0.5, keep_alive_timeout=0.5)
    with server(tokenizer, **opts) as (url, _, _):
        host, port = url.removeprefix("http://").split(":")
        head = f"POST {CMPL} HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n".encode()
        sends = [b"", head[:20], head + b"Content-Length: 100\r\n\r\n" + b'{"prompt": "x',
                 b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n"]  # the last: idle after a response
        sel = selectors.DefaultSelector()
        socks = []
        for i in range(40):
            s = socket.create_connection((host, int(port)))
            s.sendall(sends[i % len(sends)])
            s.setblocking(False)
            sel.register(s, selectors.EVENT_READ)
            socks.append(s)
        open_ = set(socks)
        deadline = time.monotonic() + 30  # a bound for a hung server, not a timing assertion
        while open_ and time.monotonic() < deadline:
            for key, _ in sel.select(timeout=1):
                try:
                    data = key.fileobj.recv(65536)
                except ConnectionResetError:
                    data = b""
                if not data:  # closed by the server
                    sel.unregister(key.fileobj)
                    open_.discard(key.fileobj)
        for s in socks:
            s.close()
        assert not open_, f"{len(open_)} of {len(socks)} connections still open"
        with httpx.Client(timeout=30) as c:  # the server itself is fine
            assert c.get(url + "/health").status_code == 200


def test_generation_deadline_ends_requests_with_abort(tokenizer):
    """A request past --request-timeout ends with vLLM's finish_reason "abort" (not an OpenAI value: "timeout");
    the requests metric names the cause."""
    engine, model = script_engine(tokenizer)
    engine.request_timeout = 0.3
    model.delay = 0.02  # 200 tokens would take at least 4 s
    with ServerThread(build_app(engine)) as srv, httpx.Client(timeout=60) as c:
        r = c.post(srv.url + CMPL, json={"prompt": "Hi", "max_tokens": 200, "ignore_eos": True})
        assert r.status_code == 200
        choice = r.json()["choices"][0]
        assert choice["finish_reason"] == "abort" and r.json()["usage"]["completion_tokens"] < 200
        with c.stream("POST", srv.url + CMPL, json={"prompt": "Hi", "max_tokens": 200, "stream": True}) as s:
            data = [ln[6:] for ln in s.iter_lines() if ln.startswith("data: ")]
        assert data[-1] == "[DONE]" and json.loads(data[-2])["choices"][0]["finish_reason"] == "abort"
        assert 'tokenhaul_requests_total{finish_reason="timeout"} 2.0' in c.get(srv.url + "/metrics").text
        wait_idle(engine)
        assert engine.client.core_thread.stats.kv_blocks_used == 0


def test_generation_deadline_sends_text_held_for_a_stop_string(tokenizer):
    """At the deadline (finish_reason "abort") the text held back as a possible stop-string prefix is sent, streamed
    or not: the request ended at no stop string."""
    engine, model = script_engine(tokenizer)
    with ServerThread(build_app(engine)) as srv, httpx.Client(timeout=30) as c:
        body = {"prompt": "Hi", "max_tokens": 60, "ignore_eos": True, "temperature": 0}
        ref = c.post(srv.url + CMPL, json=body).json()["choices"][0]["text"]
        stop = ref[:MAX_STOP_CHARS - 1] + "\x00"  # every output so far is a prefix of it: all of it held back
        engine.request_timeout = 0.5
        model.delay = 0.02  # 60 tokens would take at least 1.2 s
        r = c.post(srv.url + CMPL, json=body | {"stop": stop}).json()
        choice = r["choices"][0]
        assert choice["finish_reason"] == "abort" and 0 < r["usage"]["completion_tokens"] < 60
        cut = choice["text"].rstrip("\ufffd")  # where the deadline fell inside a character, as at a length finish
        assert cut and ref.startswith(cut)
        with c.stream("POST", srv.url + CMPL, json=body | {"stop": stop, "stream": True}) as s:
            data = [json.loads(ln[6:]) for ln in s.iter_lines() if ln.startswith("data: ") and ln != "data: [DONE]"]
        text = "".join(ch["text"] for d in data for ch in d["choices"]).rstrip("\ufffd")
        assert text and ref.startswith(text) and data[-1]["choices"][0]["finish_reason"] == "abort"
        wait_idle(engine)
