"""The HTTP side of the load: streamed /v1/completions requests, timed per chunk, sent as a Poisson process."""

from __future__ import annotations

import asyncio
import json
import math
import random
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

import httpx

from tokenhaul.bench.loadgen.datasets import PromptSpec
from tokenhaul.errors import TokenhaulError


@dataclass
class RequestResult:
    ok: bool
    start: float = 0.0
    ttft: float | None = None
    e2e: float = 0.0
    itls: list[float] = field(default_factory=list)
    output_tokens: int = 0
    prompt_tokens: int = 0
    error: str | None = None
    replica: str | None = None  # the x-tokenhaul-replica header: which engine replica served it

    @property
    def tpot(self) -> float | None:
        if self.ttft is None or self.output_tokens < 2:
            return None
        return (self.e2e - self.ttft) / (self.output_tokens - 1)


def base_url(url: str) -> str:
    """The server's root: `url` less a trailing slash and /v1."""
    url = url.rstrip("/")
    return url[:-3] if url.endswith("/v1") else url


async def _one(client: httpx.AsyncClient, url: str, body: dict) -> RequestResult:
    """One streamed completion, timed: TTFT, every inter-chunk gap, E2E; its error, if any, in one line."""
    res = RequestResult(ok=False, start=time.perf_counter())
    chunks, last = 0, res.start
    try:
        async with client.stream("POST", url + "/v1/completions", json=body) as r:
            if r.status_code != 200:
                res.error = f"HTTP {r.status_code}: {(await r.aread()).decode(errors='replace')[:200]}"
                return res
            res.replica = r.headers.get("x-tokenhaul-replica")
            async for line in r.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                obj = json.loads(data)
                if "error" in obj:
                    res.error = str(obj["error"])[:200]
                    return res
                if obj.get("usage"):
                    res.output_tokens = int(obj["usage"].get("completion_tokens") or 0)
                    res.prompt_tokens = int(obj["usage"].get("prompt_tokens") or 0)
                if any(c.get("text") for c in obj.get("choices") or ()):
                    now = time.perf_counter()
                    if res.ttft is None:
                        res.ttft = now - res.start
                    else:
                        res.itls.append(now - last)
                    last = now
                    chunks += 1
    except (httpx.HTTPError, json.JSONDecodeError) as e:
        res.error = f"{type(e).__name__}: {e}"[:200]
        return res
    res.e2e = time.perf_counter() - res.start
    res.output_tokens = res.output_tokens or chunks
    res.ok = True
    return res


async def run_load(url: str, specs: list[PromptSpec], model: str | None = None, concurrency: int | None = None,
                   rate: float = math.inf, seed: int = 0, temperature: float = 0.0, ignore_eos: bool = True,
                   extra_body: dict | None = None, warmup: int = 1,
                   after_warmup: Callable[[], Awaitable[None]] | None = None) -> tuple[list[RequestResult], float, str]:
    """Send every spec, after `warmup` short ones and then `after_warmup` (awaited); returns (results in send order,
    wall seconds of the measured run, model)."""
    url = base_url(url)
    limit = concurrency or len(specs)
    limits = httpx.Limits(max_connections=limit + 4, max_keepalive_connections=limit + 4)
    async with httpx.AsyncClient(timeout=httpx.Timeout(None, connect=30.0), limits=limits) as client:
        if model is None:
            model = await _served_model(client, url)

        def body(s: PromptSpec) -> dict:
            return {"model": model, "prompt": s.prompt, "max_tokens": s.max_tokens, "stream": True,
                    "stream_options": {"include_usage": True}, "temperature": temperature,
                    "ignore_eos": ignore_eos, **(extra_body or {})}

        for s in specs[:warmup]:
            await _one(client, url, body(PromptSpec(s.prompt, min(s.max_tokens, 4))))
        if after_warmup is not None:
            await after_warmup()
        sem = asyncio.Semaphore(limit)
        rng = random.Random(seed)

        async def bounded(s: PromptSpec) -> RequestResult:
            async with sem:
                return await _one(client, url, body(s))

        tasks = []
        t0 = time.perf_counter()
        for i, s in enumerate(specs):
            tasks.append(asyncio.create_task(bounded(s)))
            if math.isfinite(rate) and i + 1 < len(specs):
                await asyncio.sleep(rng.expovariate(rate))
        results = await asyncio.gather(*tasks)
        return list(results), time.perf_counter() - t0, model


async def _served_model(client: httpx.AsyncClient, url: str) -> str:
    """The first model the server at `url` lists (GET /v1/models); a one-line TokenhaulError where there is none."""
    try:
        r = await client.get(url + "/v1/models")
        return r.json()["data"][0]["id"]
    except httpx.HTTPError as e:
        raise TokenhaulError(f"cannot reach {url}: {type(e).__name__}: {e}") from None
    except (ValueError, KeyError, IndexError, TypeError):
        raise TokenhaulError(f"{url}/v1/models answered HTTP {r.status_code} without a model: {r.text[:200]!r}; "
                             f"pass --model") from None
