"""A failing step fails only the request that causes it; internals stay in the log; a dead engine
loop is seen as dead by everyone who hears of it, and makes `serve` fail (non-zero exit)."""

from __future__ import annotations

import os
import signal
import threading

import httpx
import pytest
from serverkit import ServerThread, script_engine, wait_idle

from tokenhaul.engine.core_thread import CoreThread
from tokenhaul.engine.messages import AddRequest, CoreOutputs
from tokenhaul.sampling_params import SamplingParams
from tokenhaul.server.app import EngineDied, build_app, serve

POISON = 4242  # a prompt holding this token id makes the scripted model's forward raise
GREEDY = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)


def poison_when_seen(model) -> None:
    real = model.forward

    def forward(input_ids, meta, kv):
        if bool((input_ids == POISON).any()):
            raise RuntimeError("secret internal detail: kernel blew up")
        return real(input_ids, meta, kv)

    model.forward = forward


def run_core_thread(ct: CoreThread, msgs: list[AddRequest]) -> dict[str, list]:
    """Queue every message before the loop starts (so they share the first step), run until each
    request finished or failed; returns request id → [tokens, finish reason or failure text]."""
    done = threading.Event()
    got: dict[str, list] = {m.request_id: [[], None] for m in msgs}

    def on_outputs(out: CoreOutputs) -> None:
        for d in out.deltas:
            got[d.request_id][0] += d.new_token_ids
            if d.finished:
                got[d.request_id][1] = d.finish_reason
        for rid, why in out.failed:
            got[rid][1] = "failed: " + why
        if all(v[1] is not None for v in got.values()):
            done.set()

    ct._on_outputs = on_outputs
    for m in msgs:
        ct.add(m)
    ct.start()
    assert done.wait(60), got
    ct.shutdown()
    return got


def test_failing_request_is_isolated_and_the_batch_goes_on(tokenizer):
    prompts = {f"ok{i}": [5 + i, 17, 300 + i, 9] * (1 + i) for i in range(6)}
    engine, model = script_engine(tokenizer)
    alone = run_core_thread(CoreThread(engine.client.core_thread.core, lambda o: None),
                            [AddRequest(rid, p, GREEDY) for rid, p in prompts.items()])
    engine, model = script_engine(tokenizer)
    poison_when_seen(model)
    msgs = [AddRequest(rid, p, GREEDY) for rid, p in prompts.items()]
    msgs.insert(3, AddRequest("bad", [5, POISON, 7], GREEDY))
    ct = CoreThread(engine.client.core_thread.core, lambda o: None)
    got = run_core_thread(ct, msgs)
    assert got["bad"][0] == [] and got["bad"][1].startswith("failed: ")
    assert "bad" in got["bad"][1] and "kernel blew up" not in got["bad"][1]  # an id to find, no internals
    for rid in prompts:
        assert got[rid] == [alone[rid][0], "length"], rid  # the same tokens as without the poisoned request
    assert ct.core.pool.num_used == 0 and not ct.core.has_unfinished()


def test_a_request_failing_to_be_added_fails_alone(tokenizer):
    """A defect reached while adding one request (not a RequestError) fails that request, generically; the loop
    and the other requests go on."""
    engine, _ = script_engine(tokenizer)
    core = engine.client.core_thread.core
    real = core.add_request

    def add_request(rid, *args, **kw):
        if rid == "bad":
            raise ValueError("secret internal detail")
        return real(rid, *args, **kw)

    core.add_request = add_request
    got = run_core_thread(CoreThread(core, lambda o: None),
                          [AddRequest("ok", [5, 17, 9], GREEDY), AddRequest("bad", [5, 7], GREEDY)])
    assert got["bad"][1].startswith("failed: ") and "secret" not in got["bad"][1]
    assert len(got["ok"][0]) == 12 and got["ok"][1] == "length"
    assert core.pool.num_used == 0 and not core.has_unfinished()


def test_http_failure_is_generic_with_request_id_and_spares_others(tokenizer, caplog):
    engine, model = script_engine(tokenizer)
    poison_when_seen(model)
    model.delay = 0.01
    with ServerThread(build_app(engine)) as srv, httpx.Client(timeout=60) as c:
        results = {}

        def post(name: str, prompt: str | list[int]) -> None:
            results[name] = c.post(srv.url + "/v1/completions", json={"prompt": prompt, "max_tokens": 30})

        threads = [threading.Thread(target=post, args=(f"ok{i}", f"Hello {i}")) for i in range(3)]
        threads.append(threading.Thread(target=post, args=("bad", [15, POISON, 20])))
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        bad = results.pop("bad")
        assert bad.status_code == 500, bad.text
        err = bad.json()["error"]
        assert err["code"] == "engine_error" and "kernel blew up" not in err["message"]
        assert "cmpl-" in err["message"]  # the request id, to find the traceback in the log
        assert "kernel blew up" in caplog.text
        for r in results.values():
            assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 30
        wait_idle(engine)
        assert engine.client.core_thread.stats.kv_blocks_used == 0
        assert c.get(srv.url + "/health").status_code == 200


def test_a_dead_loop_is_dead_before_its_death_is_announced(tokenizer):
    engine, model = script_engine(tokenizer)

    def die(*a):
        raise SystemExit("simulated crash of the loop")

    model.forward = die
    seen = []
    ct = CoreThread(engine.client.core_thread.core, lambda out: seen.append((out.dead, ct.alive)))
    ct.add(AddRequest("r", [1, 2, 3], GREEDY))
    ct.run()
    assert len(seen) == 1 and seen[0][0] is not None and seen[0][1] is False
    assert "simulated crash" not in seen[0][0] and isinstance(ct.error, SystemExit)


def test_engine_death_makes_serve_fail(tokenizer, unused_port):
    """serve() runs the step loop in this (main) thread; when the loop dies, serve raises (the CLI
    turns it into a non-zero exit status) after clients got their error."""
    engine, model = script_engine(tokenizer)

    def die(*a):
        raise SystemExit("simulated crash of the loop")

    model.forward = die
    url = f"http://127.0.0.1:{unused_port}"
    statuses = []

    def client() -> None:
        with httpx.Client(timeout=30) as c:
            for _ in range(500):
                try:
                    statuses.append(c.post(url + "/v1/completions", json={"prompt": "Hi", "max_tokens": 5}))
                    return
                except httpx.ConnectError:
                    threading.Event().wait(0.05)

    t = threading.Thread(target=client)
    t.start()
    with pytest.raises(EngineDied):
        serve(engine, port=unused_port, log_level="warning", shutdown_timeout=5)
    t.join(30)
    assert statuses and statuses[0].status_code == 500
    assert "simulated crash" not in statuses[0].text


def test_sigterm_drains_streams_in_flight_then_returns(tokenizer, unused_port):
    """SIGTERM while streams run: /health and new requests get 503, every stream in flight ends
    normally ([DONE], finish_reason "length"), and serve() returns (exit status 0). The model is
    held at a gate while the 503s are checked, so nothing here depends on timing."""
    engine, model = script_engine(tokenizer)
    gate = threading.Event()
    gate.set()
    real = model.forward

    def forward(input_ids, meta, kv):
        while not gate.wait(0.05):  # short waits: the SIGTERM handler runs in this (main) thread
            pass
        return real(input_ids, meta, kv)

    model.forward = forward
    url = f"http://127.0.0.1:{unused_port}"
    report: dict = {}

    def client() -> None:
        try:
            with httpx.Client(timeout=30) as c:
                for _ in range(600):
                    try:
                        if c.get(url + "/health").status_code == 200:
                            break
                    except httpx.ConnectError:
                        threading.Event().wait(0.05)
                body = {"prompt": "Hi", "max_tokens": 40, "stream": True}
                streams = [c.stream("POST", url + "/v1/completions", json=body) for _ in range(3)]
                lines = []
                for s in streams:
                    it = s.__enter__().iter_lines()
                    assert next(it).startswith("data: {")  # in flight
                    lines.append(it)
                gate.clear()
                os.kill(os.getpid(), signal.SIGTERM)
                for _ in range(600):
                    if c.get(url + "/health").status_code == 503:
                        break
                    threading.Event().wait(0.05)
                report["health"] = c.get(url + "/health").status_code
                report["new"] = c.post(url + "/v1/completions", json={"prompt": "Hi", "max_tokens": 2}).status_code
                gate.set()
                report["ends"] = [[ln for ln in it if ln.startswith("data: ")][-2:] for it in lines]
                for s in streams:
                    s.__exit__(None, None, None)
        except BaseException as e:  # never leave serve() running: stop it now
            report["error"] = e
            gate.set()
            os.kill(os.getpid(), signal.SIGINT)
            os.kill(os.getpid(), signal.SIGINT)

    t = threading.Thread(target=client)
    t.start()
    serve(engine, port=unused_port, log_level="warning", shutdown_timeout=60)
    t.join(30)
    assert "error" not in report, report.get("error")
    assert report["health"] == 503 and report["new"] == 503
    for last, done in report["ends"]:
        assert done == "data: [DONE]" and '"finish_reason":"length"' in last
