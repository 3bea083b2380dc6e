"""Two engine replicas (Ray actors, 1 thread each, the real SmolLM2) behind one OpenAI endpoint:
answers through the `openai` client, cache-aware routing, aggregated /metrics and /health, and a
replica killed under load. One local Ray instance for the module (started and stopped here)."""

from __future__ import annotations

import asyncio
import json
import re
import time
from collections.abc import Iterator

import httpx
import openai
import pytest
from raykit import on_loop
from serverkit import MODEL, ServerThread

from tokenhaul import cli
from tokenhaul.bench import loadgen
from tokenhaul.cluster.pool import ReplicaPool
from tokenhaul.sampling_params import SamplingParams
from tokenhaul.server.app import build_app
from tokenhaul.server.async_engine import AsyncEngine

pytestmark = [pytest.mark.ray, pytest.mark.real_model]
ENGINE = {"threads": 1, "dtype": "bf16", "num_kv_blocks": 192, "max_model_len": 1024, "max_num_seqs": 16}
LONG = ("You are a careful assistant for a parcel delivery company. Answer in one short sentence, "
        "name the depot when you know it, never invent tracking numbers, and say when you are unsure. "
        "Depots: North (open 6-22), Harbour (open 8-18), Airport (open all day), Old Town (closed Sundays). ")


@pytest.fixture(scope="module")
def cluster(tokenizer) -> Iterator[tuple[str, AsyncEngine, ReplicaPool]]:
    pool = ReplicaPool(MODEL, 2, ENGINE)
    engine = AsyncEngine(pool, tokenizer, MODEL)
    with ServerThread(build_app(engine)) as srv:
        yield srv.url, engine, pool
    # the app's lifespan shut the pool down, and with it the Ray instance it started


def metric(text: str, name: str, **labels: str) -> float:
    sel = ",".join(f'{k}="{v}"' for k, v in labels.items())
    m = re.search(rf"^{re.escape(name)}{re.escape('{' + sel + '}') if sel else ''} ([0-9.e+-]+)$", text, re.M)
    assert m, (name, labels)
    return float(m.group(1))


def wait_idle(url: str, timeout: float = 60.0) -> str:
    """Until every replica reports an empty batch and no KV block in use; returns /metrics."""
    deadline = time.monotonic() + timeout
    while True:
        text = httpx.get(url + "/metrics", timeout=10).text
        if all(metric(text, "tokenhaul_kv_blocks_used", replica=r) == 0
               and metric(text, "tokenhaul_requests_running", replica=r) == 0 for r in "01"):
            return text
        assert time.monotonic() < deadline, text
        time.sleep(0.3)


def test_openai_client_answers_from_both_replicas(cluster):
    url, _, _ = cluster
    client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=120)
    seen, texts = set(), set()
    for _ in range(2):  # a short prompt has no full block to be affine to: least loaded, ties alternate
        raw = client.completions.with_raw_response.create(model=MODEL, prompt="The capital of France is",
                                                          max_tokens=8, temperature=0)
        seen.add(raw.headers["x-tokenhaul-replica"])
        c = raw.parse()
        assert c.choices[0].finish_reason in ("length", "stop") and c.usage.completion_tokens > 0
        texts.add(c.choices[0].text)
    assert seen == {"0", "1"}
    assert len(texts) == 1 and texts.pop().strip()  # greedy: the same answer whichever replica served it
    raw = client.chat.completions.with_raw_response.create(
        model=MODEL, messages=[{"role": "user", "content": "Say hello."}], max_tokens=8, temperature=0, stream=True)
    assert raw.headers["x-tokenhaul-replica"] in ("0", "1")
    text = "".join(ch.choices[0].delta.content or "" for ch in raw.parse() if ch.choices)
    assert text.strip()


def test_prompt_logprobs_echo_and_n_through_replicas(cluster):
    """This session's request fields cross the Ray actors: prompt logprobs (with ranks) and echo's prompt
    logprobs are the same from either replica, and n seeded samples come back as n choices."""
    url, _, _ = cluster
    body = {"model": MODEL, "prompt": "The capital of France is", "max_tokens": 2, "temperature": 0,
            "prompt_logprobs": 2, "echo": True, "logprobs": 1}
    got = {}
    for _ in range(2):  # short prompts alternate between the replicas
        r = httpx.post(url + "/v1/completions", json=body, timeout=120)
        assert r.status_code == 200, r.text
        got[r.headers["x-tokenhaul-replica"]] = r.json()["choices"][0]
    assert set(got) == {"0", "1"}
    a, b = got["0"], got["1"]
    assert a["prompt_logprobs"] == b["prompt_logprobs"] and a["prompt_logprobs"][0] is None
    assert all(e[k]["rank"] >= 1 for e in a["prompt_logprobs"][1:] for k in e)
    lp = a["logprobs"]
    assert lp["token_logprobs"][0] is None and len(lp["tokens"]) == len(a["prompt_logprobs"]) + 2
    assert lp["token_logprobs"] == b["logprobs"]["token_logprobs"]
    r = httpx.post(url + "/v1/completions", json={"model": MODEL, "prompt": "Once upon a time", "max_tokens": 4,
                                                  "temperature": 1.0, "seed": 3, "n": 3}, timeout=120)
    assert r.status_code == 200, r.text
    assert sorted(c["index"] for c in r.json()["choices"]) == [0, 1, 2]


def test_shared_prefix_sticks_distinct_prefixes_spread(cluster):
    url, _, _ = cluster
    before = httpx.get(url + "/metrics").text

    async def ask(client: httpx.AsyncClient, prompt: str) -> str:
        r = await client.post(url + "/v1/completions", json={"model": MODEL, "prompt": prompt, "max_tokens": 4,
                                                             "temperature": 0, "ignore_eos": True})
        assert r.status_code == 200, r.text
        return r.headers["x-tokenhaul-replica"]

    async def main() -> tuple[list[str], list[str]]:
        async with httpx.AsyncClient(timeout=120) as c:
            shared = [await ask(c, LONG + f"Question {i}: where is my parcel?") for i in range(4)]
            distinct = await asyncio.gather(*(ask(c, f"Topic {i}. " * 30 + "Summarise.") for i in range(4)))
        return shared, list(distinct)

    shared, distinct = asyncio.run(main())
    assert len(set(shared)) == 1, shared  # one replica holds the long prefix: the rest follow it there
    assert sorted(distinct) == ["0", "0", "1", "1"], distinct  # four prefixes at once: two each
    after = wait_idle(url)
    home = shared[0]
    hits = (metric(after, "tokenhaul_prefix_cache_hit_tokens_total", replica=home)
            - metric(before, "tokenhaul_prefix_cache_hit_tokens_total", replica=home))
    assert hits >= 3 * 64  # the three followers each reused the prefix's full blocks (>= 4 blocks of 16)
    routed = {d: metric(after, "tokenhaul_routing_total", decision=d) - metric(before, "tokenhaul_routing_total",
                                                                               decision=d)
              for d in ("affinity", "unmatched", "spilled")}
    assert routed == {"affinity": 3, "unmatched": 5, "spilled": 0}


def test_metrics_and_health_per_replica(cluster):
    url, _, pool = cluster
    text = wait_idle(url)
    for r in "01":
        assert metric(text, "tokenhaul_kv_blocks_total", replica=r) == pool.limits.num_blocks
        assert metric(text, "tokenhaul_engine_steps_total", replica=r) > 0
    assert 'tokenhaul_routing_total{decision="affinity"}' in text
    assert "tokenhaul_time_to_first_token_seconds_count" in text  # front-end histograms stay whole
    h = httpx.get(url + "/health").json()
    assert h["status"] == "ok"
    assert set(h["replicas"]) == {"0", "1"}
    assert all(r["status"] == "ok" and "pid" in r["where"] for r in h["replicas"].values())


def test_bench_serve_reports_each_replica(cluster):
    url, _, _ = cluster
    s = loadgen.benchmark(url, loadgen.random_dataset(8, 24, 4), concurrency=4)
    assert s["completed"] == 8 and set(s["per_replica"]) == {"0", "1"}, s["per_replica"]
    assert sum(v["completed"] for v in s["per_replica"].values()) == 8
    assert s["prefix_hit_rate"] < 0.5  # distinct prompts: little to share (a chat-free lead word at most)
    for name in "01":  # the client's view (by the header) and each replica's own ledger, side by side
        assert s["per_replica"][name]["ttft_ms"]["p50"] > 0 and s["per_replica"][name]["itl_ms"]["p99"] > 0
        led = s["ledger"]["per_replica"][name]
        assert led["prompt_tokens_computed"] > 0 and led["engine_steps"] > 0
        assert led["prefix_miss"]["tokens"] > 0 and led["prefix_miss"]["kv_bytes"] > 0
    assert s["ledger"]["prompt_tokens_computed"] == sum(v["prompt_tokens_computed"]
                                                        for v in s["ledger"]["per_replica"].values())
    assert s["ledger"]["duplicate_prefix"]["tokens"] == 0  # nothing shared, nothing computed twice
    table = loadgen.format_table(s)
    assert "\n0 " in table and "\n1 " in table and "\ntotal " in table and "prefix-cache misses" in table


def test_ledger_gathers_step_records_from_every_replica(cluster, tmp_path, capsys):
    url, _, _ = cluster
    before = httpx.get(url + "/ledger").json()
    assert set(before["replicas"]) == {"0", "1"} and all(not r["step_records"] for r in before["replicas"].values())

    async def ask() -> list[httpx.Response]:  # four new prefixes at once: two on each replica
        async with httpx.AsyncClient(timeout=120) as c:
            return await asyncio.gather(*(c.post(url + "/v1/completions", json={
                "model": MODEL, "prompt": f"Ledger topic {i}. " * 20, "max_tokens": 3, "temperature": 0,
                "ignore_eos": True}) for i in range(4)))

    served = asyncio.run(ask())
    assert all(r.status_code == 200 for r in served)
    assert sorted(r.headers["x-tokenhaul-replica"] for r in served) == ["0", "0", "1", "1"]
    since = min(r["last_step"] for r in before["replicas"].values())
    after = httpx.get(url + "/ledger", params={"since": since}).json()
    for name, snap in after["replicas"].items():
        assert snap["steps"] > before["replicas"][name]["steps"]
        assert snap["step_records"] and all(rec["replica"] == name and rec["bytes"] > 0
                                            for rec in snap["step_records"])
        assert "pid" in snap["where"] and snap["kv_bytes_per_token"] > 0
        assert snap["prefix_miss"]["tokens"] >= 2 * 20 * 3  # at least its two new prompts' tokens missed
    assert "duplicate_prefix_tokens" in after["routing"]
    cli.main(["trace", "--url", url, "--out", str(tmp_path)])  # saved for `whatif --replay`, replicas named
    saved = [json.loads(line) for line in (tmp_path / "steps.jsonl").read_text().splitlines()]
    assert {rec["replica"] for rec in saved} == {"0", "1"} and any(rec["chunks"] for rec in saved)
    printed = capsys.readouterr().out
    assert "replica 0 (node" in printed and "replica 1 (node" in printed and "prefix misses" in printed


def test_killed_replica_loses_no_unstreamed_request_and_comes_back(cluster):
    url, engine, pool = cluster
    loop = engine._loop
    max_tokens = 64

    async def stream(client: httpx.AsyncClient, prompt: str, started: asyncio.Event | None) -> dict:
        body = {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
                "stream": True, "logprobs": 0}  # logprobs: every token makes a chunk, even an empty-text one
        res = {"tokens": 0, "error": None, "finish": None}
        async with client.stream("POST", url + "/v1/completions", json=body) as r:
            res["replica"] = r.headers["x-tokenhaul-replica"]
            async for line in r.aiter_lines():
                if not line.startswith("data: {"):
                    continue
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    res["error"] = chunk["error"]["message"]
                    continue
                for c in chunk["choices"]:
                    res["tokens"] += len(c["logprobs"]["tokens"]) if c.get("logprobs") else 0
                    res["finish"] = c.get("finish_reason") or res["finish"]
                if started is not None and res["tokens"]:
                    started.set()
        return res

    async def admit_and_kill() -> tuple[list, list]:
        """On the server's loop, in one turn: admit four requests (none can have streamed), kill replica 0."""
        params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
        streams = [engine.add_request([engine.tokenizer.encode(f"Fresh question {i} " * 10)], [params], f"late{i}")
                   for i in range(4)]
        on_zero = [s for s in streams if s.replica == "0"]
        pool.kill("0")
        return streams, on_zero

    async def read(s) -> int:
        n = 0
        async with s:
            async for items in s:
                n += sum(len(d.token_ids) for _, d in items)
        return n

    async def main() -> tuple[list[dict], list[int], list, int]:
        async with httpx.AsyncClient(timeout=180) as c:
            events = [asyncio.Event() for _ in range(4)]
            early = [asyncio.create_task(stream(c, f"Story number {i}. " * 8, events[i])) for i in range(4)]
            await asyncio.wait_for(asyncio.gather(*(e.wait() for e in events)), 120)  # all four have streamed
            streams, on_zero = await asyncio.wrap_future(asyncio.run_coroutine_threadsafe(admit_and_kill(), loop))
            late = await asyncio.gather(*(asyncio.wrap_future(asyncio.run_coroutine_threadsafe(read(s), loop))
                                          for s in streams))
            return await asyncio.gather(*early), list(late), streams, len(on_zero)

    early, late, streams, late_on_zero = asyncio.run(main())
    assert sorted(r["replica"] for r in early) == ["0", "0", "1", "1"]
    for r in early:  # streamed on the killed replica: a clean error; on the other: complete
        if r["replica"] == "0":
            assert r["error"] and "replica 0 failed" in r["error"] and 0 < r["tokens"] < max_tokens, r
        else:
            assert r["error"] is None and r["tokens"] == max_tokens and r["finish"] == "length", r
    assert late_on_zero > 0 and late == [8] * 4  # not streamed yet: retried on replica 1, none lost
    assert [s.replica for s in streams] == ["1"] * 4  # the header names where they ran
    assert pool.routing()["retried"] == late_on_zero and pool.routing()["replica_failures"] == 1

    deadline = time.monotonic() + 240  # Ray restarts the actor; it reloads the model
    while httpx.get(url + "/health").json()["replicas"]["0"]["status"] != "ok":
        assert time.monotonic() < deadline, "replica 0 did not come back"
        time.sleep(1.0)

    async def again() -> list[str]:
        async with httpx.AsyncClient(timeout=120) as c:
            rs = await asyncio.gather(*(c.post(url + "/v1/completions", json={
                "model": MODEL, "prompt": f"After the restart {i}, " * 6, "max_tokens": 4, "temperature": 0})
                for i in range(4)))
        assert all(r.status_code == 200 for r in rs)
        return sorted(r.headers["x-tokenhaul-replica"] for r in rs)

    assert asyncio.run(again()) == ["0", "0", "1", "1"]  # the pool is whole again
    text = wait_idle(url)  # KV pools back to full on both replicas
    for r in "01":
        assert metric(text, "tokenhaul_kv_blocks_used", replica=r) == 0
    assert on_loop(loop, lambda: engine.num_unfinished) == 0
