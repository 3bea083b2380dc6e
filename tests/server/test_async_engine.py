"""AsyncEngine ↔ CoreThread, without HTTP: the step loop runs only in the core thread, aborts free KV
blocks, a slow reader never stalls the engine (its deltas coalesce), core failures reach the caller."""

from __future__ import annotations

import asyncio
import contextlib
import time

import httpx
import pytest
from serverkit import ServerThread, script_engine, wait_idle

from tokenhaul.sampling_params import SamplingParams
from tokenhaul.server.app import build_app
from tokenhaul.server.async_engine import EngineFailed

GREEDY = SamplingParams(max_tokens=24, temperature=0)


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, 60))


async def _idle(engine) -> None:
    for _ in range(3000):
        s = engine.client.core_thread.stats
        if engine.num_unfinished == 0 and s.num_running == 0 and s.num_waiting == 0:
            return
        await asyncio.sleep(0.01)
    raise AssertionError(f"not idle: {engine.client.core_thread.stats}")


def test_generate_runs_steps_only_in_core_thread(tokenizer):
    engine, model = script_engine(tokenizer)

    async def main():
        await engine.start()
        try:
            prompt = tokenizer.encode("Hello")
            deltas = [d async for d in engine.generate("t", prompt, GREEDY)]
            return deltas
        finally:
            await engine.shutdown()

    deltas = run(main())
    assert model.threads == {"tokenhaul-core"}
    assert deltas[-1].finished and deltas[-1].finish_reason == "length"
    assert deltas[-1].num_output_tokens == 24 == sum(len(d.token_ids) for d in deltas)
    assert sum(len(d.token_ids) for d in deltas[:-1]) < 24  # more than one delta: it streamed
    text = "".join(d.text for d in deltas)
    ref = tokenizer.decode(sum((d.token_ids for d in deltas), []))
    assert text == ref


def test_abort_on_close_frees_kv_blocks(tokenizer):
    engine, model = script_engine(tokenizer)
    model.delay = 0.01

    async def main():
        await engine.start()
        try:
            gen = engine.generate("t", tokenizer.encode("Hello " * 40), SamplingParams(max_tokens=200, temperature=0))
            async with contextlib.aclosing(gen):
                async for d in gen:
                    if d.num_output_tokens >= 3:
                        break
            assert engine.num_unfinished == 0
            await _idle(engine)
            return engine.client.core_thread.stats
        finally:
            await engine.shutdown()

    stats = run(main())
    assert stats.kv_blocks_used == 0 and stats.num_running == 0
    assert stats.num_steps < 150  # stopped long before max_tokens


def test_slow_reader_does_not_stall_others(tokenizer):
    engine, model = script_engine(tokenizer)

    async def main():
        await engine.start()
        try:
            prompt = tokenizer.encode("Hi")
            params = SamplingParams(max_tokens=40, temperature=0)
            slow = engine.add_request([prompt], [params], "slow")
            fast = [d async for d in engine.generate("fast", prompt, params)]
            await _idle(engine)  # the slow stream's request finished while nobody read it
            items = [i async for i in slow]
            return fast, items
        finally:
            await engine.shutdown()

    fast, items = run(main())
    assert len(items) == 1  # every delta of the unread stream was coalesced into one
    (_, d), = items[0]
    assert d.finished and d.num_output_tokens == 40 and len(d.token_ids) == 40
    assert d.text == "".join(x.text for x in fast)


def test_core_failure_reaches_the_reader_and_server_survives(tokenizer):
    engine, model = script_engine(tokenizer)
    calls = {"n": 0}
    real_forward = model.forward

    def flaky(input_ids, meta, kv):
        calls["n"] += 1
        if calls["n"] == 3:
            raise RuntimeError("simulated kernel failure")
        return real_forward(input_ids, meta, kv)

    model.forward = flaky
    with ServerThread(build_app(engine)) as srv, httpx.Client(timeout=30) as c:
        r = c.post(srv.url + "/v1/completions", json={"prompt": "Hi", "max_tokens": 10})
        assert r.status_code == 500
        assert r.json()["error"]["code"] == "engine_error"
        assert "simulated kernel failure" not in r.json()["error"]["message"]  # internals go to the log
        with c.stream("POST", srv.url + "/v1/completions", json={"prompt": "Hi", "max_tokens": 5, "stream": True}) as s:
            lines = [ln for ln in s.iter_lines() if ln.startswith("data:")]
        assert lines[-1] == "data: [DONE]"
        r = c.post(srv.url + "/v1/completions", json={"prompt": "Hi", "max_tokens": 5})
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 5
        wait_idle(engine)
        assert engine.client.core_thread.stats.kv_blocks_used == 0


def test_engine_failed_is_raised_from_stream(tokenizer):
    engine, model = script_engine(tokenizer)
    model.forward = lambda *a: (_ for _ in ()).throw(RuntimeError("boom"))

    async def main():
        await engine.start()
        try:
            with pytest.raises(EngineFailed, match="internal error .* request t-0"):
                async for _ in engine.generate("t", tokenizer.encode("Hi"), GREEDY):
                    pass
        finally:
            await engine.shutdown()

    run(main())


def test_non_streaming_client_timeout_aborts(tokenizer):
    engine, model = script_engine(tokenizer)
    model.delay = 0.02
    with ServerThread(build_app(engine)) as srv, httpx.Client(timeout=0.5) as c:
        with pytest.raises(httpx.ReadTimeout):
            c.post(srv.url + "/v1/completions", json={"prompt": "Hi", "max_tokens": 200})
        t0 = time.monotonic()
        wait_idle(engine, timeout=10)
        assert time.monotonic() - t0 < 3  # aborted, not run to 200 tokens (4 s)
        assert engine.client.core_thread.stats.kv_blocks_used == 0
        assert 'tokenhaul_requests_total{finish_reason="abort"} 1.0' in c.get(srv.url + "/metrics").text


def test_dead_core_thread_fails_requests_instead_of_hanging(tokenizer):
    engine, model = script_engine(tokenizer)

    def die(*a):
        raise SystemExit("simulated crash of the loop")

    model.forward = die
    with ServerThread(build_app(engine)) as srv, httpx.Client(timeout=30) as c:
        r = c.post(srv.url + "/v1/completions", json={"prompt": "Hi", "max_tokens": 5})
        assert r.status_code == 500 and "engine stopped" in r.json()["error"]["message"]
        assert "simulated crash" not in r.text
        assert c.get(srv.url + "/health").status_code == 503
        assert c.post(srv.url + "/v1/completions", json={"prompt": "Hi"}).status_code == 503


def test_serve_builds_the_grammar_token_table_at_load(monkeypatch):
    """llguidance's token table is built when serve loads the model, not in the first constrained request's step
    (where it stalled every stream: ~0.2 s on SmolLM2, ~2.5 s on Gemma3)."""
    from tokenhaul.decoding.grammar import GrammarCompiler
    from tokenhaul.models.catalog import is_installed
    from tokenhaul.server.async_engine import AsyncEngine

    if not is_installed("smollm2-135m"):
        pytest.skip("model smollm2-135m not installed")
    built = []
    monkeypatch.setattr(GrammarCompiler, "warm", lambda self: built.append(self))
    AsyncEngine.from_model("smollm2-135m", num_kv_blocks=16, compile="off")
    assert len(built) == 1


def test_a_request_the_core_refuses_at_admission_is_a_400(tokenizer):
    """What check_prompt does not foresee but the core refuses when it is added (a beam group's blocks: every beam
    holds its own tail) is the client's error, 400 with the core's reason, not a 500 engine failure."""
    engine, _ = script_engine(tokenizer, num_kv_blocks=12)
    body = {"prompt": "Story number 3: Once upon a time", "max_tokens": 40, "use_beam_search": True, "n": 2}
    with ServerThread(build_app(engine)) as srv, httpx.Client(timeout=30) as c:
        r = c.post(srv.url + "/v1/completions", json=body)
        assert r.status_code == 400, r.text
        err = r.json()["error"]
        assert err["code"] == "kv_capacity_exceeded" and err["message"].startswith("beam search needs"), err
        with c.stream("POST", srv.url + "/v1/completions", json=body | {"stream": True}) as s:
            lines = [ln for ln in s.iter_lines() if ln.startswith("data:")]
        assert "kv_capacity_exceeded" in lines[0] and lines[-1] == "data: [DONE]"
        r = c.post(srv.url + "/v1/completions", json={"prompt": "Hi", "max_tokens": 5})
        assert r.status_code == 200
