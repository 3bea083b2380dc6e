"""200 concurrent streamed requests on the real model, a third of them hanging up mid-stream: no
crash, every completed response equals its reference, and the KV pool is back to full afterwards.
Then the load generator against the same server."""

from __future__ import annotations

import asyncio
import json
import re

import httpx
import pytest
from serverkit import wait_idle

from tokenhaul.bench import loadgen

pytestmark = pytest.mark.real_model
PROMPTS = [f"Write one sentence about {t}." for t in
           ("the ocean", "a robot", "Paris", "bread", "the moon", "trains", "chess", "jazz", "bees", "tea")]
MAX_TOKENS = 8


def metric(text: str, name: str) -> float:
    m = re.search(rf"^{re.escape(name)} ([0-9.e+-]+)$", text, re.M)
    assert m, name
    return float(m.group(1))


async def _stream(client: httpx.AsyncClient, url: str, prompt: str, hang_up: bool) -> tuple[str, int] | None:
    body = {"prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True}}
    text, usage = "", None
    async with client.stream("POST", url + "/v1/completions", json=body) as r:
        assert r.status_code == 200
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            assert "error" not in chunk, chunk
            if chunk.get("usage"):
                usage = chunk["usage"]["completion_tokens"]
            for c in chunk["choices"]:
                text += c["text"]
            if hang_up and text:
                return None  # leaving the block closes the connection mid-stream
    return text, usage


def test_200_concurrent_third_disconnect(real_server):
    url, engine = real_server
    with httpx.Client(timeout=120) as c:
        refs = {}
        for p in PROMPTS:
            r = c.post(url + "/v1/completions", json={"prompt": p, "max_tokens": MAX_TOKENS, "temperature": 0,
                                                      "ignore_eos": True})
            refs[p] = r.json()["choices"][0]["text"]
        before = c.get(url + "/metrics").text
    wait_idle(engine)

    async def main():
        limits = httpx.Limits(max_connections=250, max_keepalive_connections=0)
        async with httpx.AsyncClient(timeout=300, limits=limits) as client:
            jobs = [_stream(client, url, PROMPTS[i % len(PROMPTS)], hang_up=i % 3 == 0) for i in range(200)]
            return await asyncio.gather(*jobs)

    results = asyncio.run(main())
    completed = [(i, r) for i, r in enumerate(results) if r is not None]
    assert len(completed) == 200 - len(range(0, 200, 3))
    for i, (text, usage) in completed:
        assert text == refs[PROMPTS[i % len(PROMPTS)]], i
        assert usage == MAX_TOKENS
    wait_idle(engine, timeout=60)
    with httpx.Client(timeout=30) as c:
        assert c.get(url + "/health").status_code == 200
        after = c.get(url + "/metrics").text
    assert engine.client.core_thread.stats.kv_blocks_used == 0
    replica = '{replica="0"}'
    assert metric(after, "tokenhaul_kv_blocks_used" + replica) == 0
    assert metric(after, "tokenhaul_requests_running" + replica) == 0
    assert metric(after, "tokenhaul_requests_waiting" + replica) == 0
    aborted = metric(after, 'tokenhaul_requests_total{finish_reason="abort"}') - (
        metric(before, 'tokenhaul_requests_total{finish_reason="abort"}')
        if 'finish_reason="abort"' in before else 0)
    assert 0 < aborted <= 67
    assert engine.num_unfinished == 0 and engine.num_waiting == 0 and not engine.processor.outputs
    assert metric(after, "tokenhaul_last_mile_seconds_count{stage=\"detokenize\"}") > 0


def test_loadgen_against_server(real_server):
    url, engine = real_server
    specs = loadgen.random_dataset(12, input_len=16, output_len=6, seed=1)
    s = loadgen.benchmark(url + "/v1", specs, slo_ttft_ms=60_000, slo_tpot_ms=60_000, concurrency=4, rate=50.0)
    assert s["completed"] == 12 and s["failed"] == 0
    assert s["output_tokens"] == 12 * 6
    assert s["good_requests"] == 12 and s["goodput"] > 0
    for k in ("ttft_ms", "tpot_ms", "itl_ms", "e2e_ms"):
        st = s[k]
        assert 0 < st["p50"] <= st["p90"] <= st["p99"], (k, st)
    assert s["last_mile_us_per_token"]["total"] > 0
    table = loadgen.format_table(s)
    assert "TTFT" in table and "goodput" in table and "last mile" in table
    wait_idle(engine)
