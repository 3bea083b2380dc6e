"""Chaos soak against the real model: 1,000+ mixed requests — streamed and not, n > 1, stop strings,
CJK and emoji, a tenth malformed, a third of the streams dropped mid-way — with every request
accounted for, no 5xx for valid input, and the KV pool back to full. Inter-token latency p50/p99 is
printed (not asserted: the machine is shared)."""

from __future__ import annotations

import asyncio
import json
import random
import statistics
import time

import httpx
import pytest
from serverkit import MODEL, ServerThread, wait_idle

from tokenhaul.server.app import build_app
from tokenhaul.server.async_engine import AsyncEngine

pytestmark = pytest.mark.real_model
NUM_REQUESTS = 1000
CONCURRENCY = 32
TEXTS = ["Hello, how are you?", "用中文写一句话。", "Emoji time: 🙂🚀🎉", "def add(a, b):", "東京の天気は？",
         "Once upon a time", "Liste trois couleurs.", "🐶🐱 + 🌧️ = ?", "Explain KV caches briefly.", "数字：一二三"]
STOPS = ["\n", ".", "。", "🙂", "the"]
MALFORMED = [
    b'{"prompt": "x",', b"[1, 2]", b'{"prompt": "Hi", "max_tokens": -1}', b'{"prompt": "Hi", "temperature": "hot"}',
    b'{"prompt": "abc\\ud800"}', b'{"prompt": "Hi", "model": "nope"}', b'{"prompt": "Hi", "n": 1000}',
    b'{"prompt": [999999999]}', b'{"messages": []}', b'{"prompt": "Hi", "stop_token_ids": "x"}',
]


def plan(rng: random.Random, i: int) -> dict:
    """One request: kind (malformed / plain / stream / drop), path and JSON body."""
    if i % 10 == 0:
        body = MALFORMED[(i // 10) % len(MALFORMED)]
        return {"kind": "malformed", "path": "/v1/chat/completions" if b"messages" in body else "/v1/completions",
                "raw": body}
    chat = rng.random() < 0.5
    body: dict = {"max_tokens": rng.randint(1, 8), "n": rng.choice([1, 1, 1, 2])}
    if chat:
        body["messages"] = [{"role": "user", "content": rng.choice(TEXTS)}]
    else:
        body["prompt"] = rng.choice(TEXTS) + " " + rng.choice(TEXTS)
    if rng.random() < 0.3:
        body["stop"] = rng.sample(STOPS, rng.randint(1, 2))
    if rng.random() < 0.5:
        body |= {"temperature": 0.8, "seed": rng.randint(0, 1000)}
    else:
        body["temperature"] = 0
    stream = rng.random() < 0.6
    kind = "plain" if not stream else ("drop" if rng.random() < 0.62 else "stream")  # ~1/3 of all: drops
    if stream:
        body["stream"] = True
    if kind == "drop":
        body["max_tokens"] = rng.randint(4, 8)  # so that leaving after the second event is mid-stream
    return {"kind": kind, "path": "/v1/chat/completions" if chat else "/v1/completions", "raw": json.dumps(body)}


async def one(c: httpx.AsyncClient, url: str, p: dict, gaps: list[float]) -> str:
    """Run one planned request; returns its outcome, or raises AssertionError describing a failure."""
    headers = {"Content-Type": "application/json"}
    if p["kind"] in ("malformed", "plain"):
        r = await c.post(url + p["path"], content=p["raw"], headers=headers)
        if p["kind"] == "malformed":
            assert 400 <= r.status_code < 500, (p, r.status_code, r.text)
            return "rejected"
        assert r.status_code == 200, (p, r.status_code, r.text)
        assert all(ch["finish_reason"] in ("stop", "length") for ch in r.json()["choices"]), r.text
        return "ok"
    async with c.stream("POST", url + p["path"], content=p["raw"], headers=headers) as r:
        assert r.status_code == 200, (p, r.status_code)
        last, lines = None, []
        async for line in r.aiter_lines():
            if not line.startswith("data: "):
                continue
            now = time.perf_counter()
            if last is not None:
                gaps.append(now - last)
            last = now
            lines.append(line)
            assert '"error"' not in line, (p, line)
            if p["kind"] == "drop" and len(lines) >= 2:
                return "dropped"  # leaving the block closes the connection mid-stream
        assert lines and lines[-1] == "data: [DONE]", (p, lines[-3:])
        return "ok"


def test_chaos_soak(tokenizer):
    engine = AsyncEngine.from_model(MODEL, num_kv_blocks=384, max_num_seqs=CONCURRENCY, max_model_len=1024)
    rng = random.Random(12)
    plans = [plan(rng, i) for i in range(NUM_REQUESTS)]
    gaps: list[float] = []
    with ServerThread(build_app(engine)) as srv:

        async def main() -> list:
            sem = asyncio.Semaphore(CONCURRENCY)
            limits = httpx.Limits(max_connections=CONCURRENCY, max_keepalive_connections=CONCURRENCY)
            async with httpx.AsyncClient(timeout=300, limits=limits) as c:

                async def guarded(p: dict) -> str | BaseException:
                    async with sem:
                        try:
                            return await one(c, srv.url, p, gaps)
                        except BaseException as e:  # collected: every request is accounted for
                            return e

                return await asyncio.gather(*(guarded(p) for p in plans))

        t0 = time.perf_counter()
        outcomes = asyncio.run(main())
        wall = time.perf_counter() - t0
        failures = [o for o in outcomes if isinstance(o, BaseException)]
        assert not failures, f"{len(failures)} of {len(plans)} failed; first: {failures[0]!r}"
        wait_idle(engine, timeout=120)
        stats = engine.client.core_thread.stats
        assert stats.kv_blocks_used == 0 and stats.num_running == 0 and stats.num_waiting == 0
        with httpx.Client(timeout=30) as c:
            assert c.get(srv.url + "/health").status_code == 200
    counts = {k: outcomes.count(k) for k in ("ok", "dropped", "rejected")}
    assert sum(counts.values()) == NUM_REQUESTS and counts["rejected"] == NUM_REQUESTS // 10
    assert counts["dropped"] >= NUM_REQUESTS * 0.3
    q = statistics.quantiles(gaps, n=100)
    print(f"\nchaos soak: {NUM_REQUESTS} requests in {wall:.1f} s, {counts}; stream inter-chunk latency "
          f"p50 {q[49] * 1e3:.1f} ms, p99 {q[98] * 1e3:.1f} ms over {len(gaps)} gaps (shared 2-core machine)")
