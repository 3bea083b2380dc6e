"""Load generator for any OpenAI-compatible server: streamed /v1/completions over httpx.

Requests arrive as a Poisson process (`rate` per second; inf → all at once), at most
`concurrency` in flight. Per request it times TTFT (first chunk with text), every inter-chunk gap
(ITL), TPOT = (E2E - TTFT) / (output tokens - 1) and E2E; the summary gives mean / p50 / p90 / p99
/ max, the ITL p99/p50 ratio (how even a stream feels), throughput, the mean number of requests in
flight, and goodput (requests per second meeting every SLO given; the ITL SLO bounds a request's
longest gap). The `mixed` dataset mixes long and short prompts, as a chat server sees them. Output token counts come
from the server's usage chunk (stream_options.include_usage), else from the number of text chunks.
If the server exports tokenhaul's /metrics, the front end's last-mile cost per token is reported;
if it has tokenhaul's /ledger, per engine replica (the `x-tokenhaul-replica` header names it) the
prefix hit rate, the prompt tokens it computed and what its prefix-cache misses cost in bytes, and
the prefix tokens computed on a second replica after another had been sent them.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import random
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import numpy as np

from tokenhaul.errors import TokenhaulError
from tokenhaul.ledger.costs import prefix_miss_cost

_WORDS = (
    "the of and to in is was for on with as by at from that this be are it an or have had not but "
    "which one all were we when there can been has more if will would who so no time its only new "
    "about other into some could them then than first may any these two like people over such our "
    "many most also after made work way should well year before between where under while water "
    "city house world school country paper music river light winter garden market engine memory "
    "number system story morning question family window letter station mountain language history"
).split()


@dataclass
class PromptSpec:
    prompt: str | list[int]
    max_tokens: int


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


# datasets ----------------------------------------------------------------------------------------
def random_dataset(n: int, input_len: int, output_len: int, range_ratio: float = 0.0,
                   seed: int = 0) -> list[PromptSpec]:
    """Text prompts of about input_len common words (≈ tokens in BPE vocabularies), distinct per
    request (a random lead so prefix caching cannot share them), max_tokens = output_len (± ratio)."""
    rng = random.Random(seed)

    def jitter(x: int) -> int:
        lo, hi = int(x * (1 - range_ratio)), int(x * (1 + range_ratio))
        return max(1, rng.randint(lo, hi))

    out = []
    for i in range(n):
        words = [str(rng.randrange(10**6)), *(rng.choice(_WORDS) for _ in range(jitter(input_len) - 1))]
        out.append(PromptSpec(f"{i} " + " ".join(words), jitter(output_len)))
    return out


def mixed_dataset(n: int, short_len: int, long_len: int, long_fraction: float, output_len: int,
                  seed: int = 0) -> list[PromptSpec]:
    """random_dataset's prompts: round(n · long_fraction) of them, at seeded places, long_len words,
    the rest short_len (both ± 20 %); exactly output_len new tokens each."""
    is_long = set(random.Random(seed).sample(range(n), round(n * long_fraction)))
    short = random_dataset(n, short_len, output_len, 0.2, seed)
    long = random_dataset(n, long_len, output_len, 0.2, seed + 1)
    return [PromptSpec((long if i in is_long else short)[i].prompt, output_len) for i in range(n)]


def file_dataset(path: str | Path, n: int, output_len: int) -> list[PromptSpec]:
    """JSONL ({"prompt": str | [ids], "max_tokens": int}) or plain text (one prompt per line); cycled to n."""
    specs = []
    for line in Path(path).read_text().splitlines():
        if not line.strip():
            continue
        if Path(path).suffix in (".jsonl", ".json") and line.lstrip().startswith("{"):
            obj = json.loads(line)
            specs.append(PromptSpec(obj["prompt"], int(obj.get("max_tokens", obj.get("output_len", output_len)))))
        else:
            specs.append(PromptSpec(line, output_len))
    if not specs:
        raise ValueError(f"{path}: no prompts")
    return [specs[i % len(specs)] for i in range(n)]


# running ------------------------------------------------------------------------------------------
def base_url(url: str) -> str:
    url = url.rstrip("/")
    return url[:-3] if url.endswith("/v1") else url


async def _one(client: httpx.AsyncClient, url: str, body: dict) -> RequestResult:
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
                   extra_body: dict | None = None, warmup: int = 1) -> tuple[list[RequestResult], float, str]:
    """Send every spec; returns (results in send order, wall seconds of the measured run, model)."""
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


async def _get(url: str, path: str, timeout: float) -> httpx.Response | None:
    """GET a path of the server at `url`; None when it cannot be reached."""
    try:
        async with httpx.AsyncClient(timeout=timeout) as c:
            return await c.get(base_url(url) + path)
    except httpx.HTTPError:
        return None


async def scrape_last_mile(url: str) -> dict[str, float] | None:
    """Sums from tokenhaul's /metrics (None if the server has no such metrics)."""
    from prometheus_client.parser import text_string_to_metric_families

    r = await _get(url, "/metrics", 10.0)
    if r is None or r.status_code != 200 or "tokenhaul_last_mile_seconds" not in r.text:
        return None
    out = {"detokenize": 0.0, "frame": 0.0, "tokens": 0.0, "hit": 0.0, "query": 0.0}
    prefix = {"tokenhaul_prefix_cache_hit_tokens_total": "hit", "tokenhaul_prefix_cache_query_tokens_total": "query"}
    for fam in text_string_to_metric_families(r.text):
        for s in fam.samples:
            if s.name == "tokenhaul_last_mile_seconds_sum":
                out[s.labels["stage"]] = s.value
            elif s.name == "tokenhaul_generation_tokens_total":
                out["tokens"] = s.value
            elif s.name in prefix:  # summed over the replicas
                out[prefix[s.name]] += s.value
    return out


async def scrape_ledger(url: str) -> dict[str, Any] | None:
    """tokenhaul's /ledger (totals per replica, no step records); None if the server has none."""
    r = await _get(url, "/ledger", 30.0)
    return r.json() if r is not None and r.status_code == 200 else None


_COUNTERS = ("steps", "prompt_tokens_computed", "generated_tokens", "recomputed_tokens", "finished_prompt_tokens",
             "finished_cached_tokens", "prefill_bytes", "prefill_flops", "prefill_tokens")


def ledger_figures(before: dict[str, Any], after: dict[str, Any]) -> tuple[dict[str, dict], dict[str, Any]]:
    """Per replica and in total, what the engines' ledgers counted between two /ledger scrapes: prefix
    hit rate, prompt tokens computed, and the cost of the prefix-cache misses (ledger/costs.py)."""
    per: dict[str, dict] = {}
    total = dict.fromkeys(_COUNTERS, 0)
    kv_per_token = 0
    for name, a in after["replicas"].items():
        b = before["replicas"].get(name)
        if b is None or b["steps"] > a["steps"]:  # new, or restarted meanwhile: its ledger began again
            b = dict.fromkeys(_COUNTERS, 0)
        d = {k: a[k] - b[k] for k in _COUNTERS}
        kv_per_token = a["kv_bytes_per_token"]
        for k in _COUNTERS:
            total[k] += d[k]
        per[name] = _ledger_row(d, kv_per_token)
    out = _ledger_row(total, kv_per_token)
    dup = after["routing"].get("duplicate_prefix_tokens", 0) - before["routing"].get("duplicate_prefix_tokens", 0)
    if "duplicate_prefix_tokens" in after["routing"]:
        out["duplicate_prefix"] = {"tokens": dup, "kv_bytes": dup * kv_per_token}
    return per, out


def _ledger_row(d: dict[str, int], kv_per_token: int) -> dict[str, Any]:
    prompt, cached = d["finished_prompt_tokens"], d["finished_cached_tokens"]
    return {"prefix_hit_rate": cached / prompt if prompt else None,
            "prompt_tokens_computed": d["prompt_tokens_computed"], "engine_steps": d["steps"],
            "recomputed_tokens": d["recomputed_tokens"],
            "prefix_miss": prefix_miss_cost(prompt - cached, kv_per_token, d["prefill_bytes"], d["prefill_flops"],
                                d["prefill_tokens"])}


# summary --------------------------------------------------------------------------------------
def _stats(xs: list[float]) -> dict[str, float | None]:
    if not xs:
        return {"mean": None, "p50": None, "p90": None, "p99": None, "max": None}
    a = np.asarray(xs) * 1e3
    return {"mean": float(a.mean()), "p50": float(np.percentile(a, 50)), "p90": float(np.percentile(a, 90)),
            "p99": float(np.percentile(a, 99)), "max": float(a.max())}


def summarize(results: list[RequestResult], wall_s: float, slo_ttft_ms: float | None = None,
              slo_tpot_ms: float | None = None, slo_e2e_ms: float | None = None,
              slo_itl_ms: float | None = None) -> dict[str, Any]:
    ok = [r for r in results if r.ok]
    out_tok = sum(r.output_tokens for r in ok)
    in_tok = sum(r.prompt_tokens for r in ok)

    def good(r: RequestResult) -> bool:
        return ((slo_ttft_ms is None or (r.ttft is not None and r.ttft * 1e3 <= slo_ttft_ms))
                and (slo_tpot_ms is None or r.tpot is None or r.tpot * 1e3 <= slo_tpot_ms)
                and (slo_e2e_ms is None or r.e2e * 1e3 <= slo_e2e_ms)
                and (slo_itl_ms is None or max(r.itls, default=0.0) * 1e3 <= slo_itl_ms))

    slos = {k: v for k, v in (("ttft_ms", slo_ttft_ms), ("tpot_ms", slo_tpot_ms), ("itl_ms", slo_itl_ms),
                              ("e2e_ms", slo_e2e_ms)) if v is not None}
    n_good = sum(good(r) for r in ok) if slos else None
    errors = [r.error for r in results if not r.ok]
    itl = _stats([x for r in ok for x in r.itls])
    return {
        "requests": len(results), "completed": len(ok), "failed": len(errors),
        "errors": sorted(set(e for e in errors if e))[:5],
        "wall_s": wall_s, "prompt_tokens": in_tok, "output_tokens": out_tok,
        "request_throughput": len(ok) / wall_s if wall_s > 0 else 0.0,
        "output_throughput": out_tok / wall_s if wall_s > 0 else 0.0,
        "total_token_throughput": (in_tok + out_tok) / wall_s if wall_s > 0 else 0.0,
        "slo": slos, "good_requests": n_good,
        "goodput": n_good / wall_s if n_good is not None and wall_s > 0 else None,
        "ttft_ms": _stats([r.ttft for r in ok if r.ttft is not None]),
        "tpot_ms": _stats([t for r in ok if (t := r.tpot) is not None]),
        "itl_ms": itl,
        "itl_p99_over_p50": itl["p99"] / itl["p50"] if itl["p50"] else None,
        "e2e_ms": _stats([r.e2e for r in ok]),
        "mean_in_flight": sum(r.e2e for r in ok) / wall_s if wall_s > 0 else 0.0,
        "per_replica": {name: _replica(rs, wall_s) for name in sorted({r.replica for r in ok if r.replica})
                        if (rs := [r for r in ok if r.replica == name]) and wall_s > 0},
    }


def _replica(rs: list[RequestResult], wall_s: float) -> dict[str, Any]:
    """The client's view of one replica: the requests it served, their throughput and latencies."""
    return {"completed": len(rs), "output_throughput": sum(r.output_tokens for r in rs) / wall_s,
            "ttft_ms": _stats([r.ttft for r in rs if r.ttft is not None]),
            "itl_ms": _stats([x for r in rs for x in r.itls])}


def _fmt(x: float | None, spec: str = ".1f") -> str:
    return "-" if x is None else format(x, spec)


def format_table(s: dict[str, Any]) -> str:
    lines = [f"completed {s['completed']}/{s['requests']} in {s['wall_s']:.2f} s | "
             f"{s['request_throughput']:.2f} req/s | output {s['output_throughput']:.1f} tok/s | "
             f"total {s['total_token_throughput']:.1f} tok/s | {s['mean_in_flight']:.1f} in flight on average"]
    if s["slo"]:
        slo = " ".join(f"{k[:-3]}≤{v:g}ms" for k, v in s["slo"].items())
        lines.append(f"goodput {s['goodput']:.2f} req/s ({s['good_requests']}/{s['completed']} meet {slo})")
    lines.append(f"{'ms':<6}{'mean':>10}{'p50':>10}{'p90':>10}{'p99':>10}{'max':>10}")
    for k in ("ttft", "tpot", "itl", "e2e"):
        st = s[f"{k}_ms"]
        lines.append(f"{k.upper():<6}" + "".join(f"{_fmt(st[q]):>10}" for q in ("mean", "p50", "p90", "p99", "max")))
    lines.append(f"ITL p99/p50 {_fmt(s['itl_p99_over_p50'], '.2f')}")
    if s.get("prefix_hit_rate") is not None:
        lines.append(f"prefix cache hit rate {s['prefix_hit_rate']:.1%} of prompt tokens (all replicas)")
    if len(s.get("per_replica") or {}) > 1 or s.get("ledger"):
        lines.append(_replica_table(s))
    led = s.get("ledger")
    if led:
        miss = led["prefix_miss"]
        lines.append(f"prefix-cache misses (all replicas): {miss['tokens']} prompt tokens computed, "
                     f"{miss['kv_bytes'] / 1e6:.1f} MB of KV written, {miss['bytes_moved'] / 1e9:.2f} GB moved, "
                     f"{miss['flops'] / 1e9:.0f} GFLOP")
        dup = led.get("duplicate_prefix")
        if dup is not None:
            lines.append(f"prefix computed again on a second replica (router's view): {dup['tokens']} tokens, "
                         f"{dup['kv_bytes'] / 1e6:.1f} MB of KV recomputed rather than reused")
    lm = s.get("last_mile_us_per_token")
    if lm is not None:
        lines.append(f"last mile (server front end) {lm['total']:.1f} µs/token = detokenize+stop "
                     f"{lm['detokenize']:.1f} + SSE framing {lm['frame']:.1f}")
    if s["errors"]:
        lines.append("errors: " + "; ".join(s["errors"]))
    return "\n".join(lines)


def _replica_table(s: dict[str, Any]) -> str:
    """One row per replica (client-side latencies, engine-side prefix figures) and the total."""
    rows = [f"{'replica':<8}{'req':>5}{'tok/s':>8}{'TTFT p50':>10}{'p99':>8}{'ITL p50':>9}{'p99':>8}"
            f"{'hit rate':>10}{'computed':>10}{'miss MB KV':>11}"]
    led = (s.get("ledger") or {}).get("per_replica", {})
    for name in sorted(set(s["per_replica"]) | set(led)):
        c, e = s["per_replica"].get(name), led.get(name)
        row = f"{name:<8}"
        row += (f"{c['completed']:>5}{c['output_throughput']:>8.1f}{_fmt(c['ttft_ms']['p50'], '.0f'):>10}"
                f"{_fmt(c['ttft_ms']['p99'], '.0f'):>8}{_fmt(c['itl_ms']['p50'], '.0f'):>9}"
                f"{_fmt(c['itl_ms']['p99'], '.0f'):>8}") if c else f"{0:>5}{'-':>8}{'-':>10}{'-':>8}{'-':>9}{'-':>8}"
        row += _ledger_cells(e)
        rows.append(row)
    t = s["ttft_ms"]
    rows.append(f"{'total':<8}{s['completed']:>5}{s['output_throughput']:>8.1f}{_fmt(t['p50'], '.0f'):>10}"
                f"{_fmt(t['p99'], '.0f'):>8}{_fmt(s['itl_ms']['p50'], '.0f'):>9}{_fmt(s['itl_ms']['p99'], '.0f'):>8}"
                + _ledger_cells(s.get("ledger")))
    return "\n".join(rows)


def _ledger_cells(e: dict[str, Any] | None) -> str:
    if not e:
        return f"{'-':>10}{'-':>10}{'-':>11}"
    hit = "-" if e["prefix_hit_rate"] is None else f"{e['prefix_hit_rate']:.1%}"
    return f"{hit:>10}{e['prompt_tokens_computed']:>10}{e['prefix_miss']['kv_bytes'] / 1e6:>11.1f}"


def benchmark(url: str, specs: list[PromptSpec], slo_ttft_ms: float | None = None,
              slo_tpot_ms: float | None = None, slo_e2e_ms: float | None = None, slo_itl_ms: float | None = None,
              **kw: Any) -> dict[str, Any]:
    """Run the load and summarize (blocking); kw go to run_load."""

    async def go() -> dict[str, Any]:
        before, led0 = await scrape_last_mile(url), await scrape_ledger(url)
        results, wall, model = await run_load(url, specs, **kw)
        s = summarize(results, wall, slo_ttft_ms, slo_tpot_ms, slo_e2e_ms, slo_itl_ms)
        after, led1 = await scrape_last_mile(url), await scrape_ledger(url)
        if led0 and led1 and led1["replicas"]:  # a server whose cores keep no ledger lists none
            per, total = ledger_figures(led0, led1)
            s["ledger"] = total | {"per_replica": per}
        s["model"] = model
        if before and after and after["tokens"] > before["tokens"]:
            n = after["tokens"] - before["tokens"]
            d = {k: (after[k] - before[k]) / n * 1e6 for k in ("detokenize", "frame")}
            s["last_mile_us_per_token"] = d | {"total": d["detokenize"] + d["frame"]}
        if s.get("ledger") and s["ledger"]["prefix_hit_rate"] is not None:
            s["prefix_hit_rate"] = s["ledger"]["prefix_hit_rate"]  # finished requests only, as per replica
        elif before and after and after["query"] > before["query"]:
            s["prefix_hit_rate"] = (after["hit"] - before["hit"]) / (after["query"] - before["query"])
        return s

    return asyncio.run(go())


# command line ---------------------------------------------------------------------------------
def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--url", default="http://127.0.0.1:8000", help="server root (with or without /v1)")
    p.add_argument("--model", default=None, help="model name to send (default: the server's first)")
    p.add_argument("--concurrency", type=int, default=None, help="at most N requests in flight")
    p.add_argument("--rate", type=float, default=math.inf, help="Poisson arrival rate, requests/s (default inf)")
    p.add_argument("--num-requests", type=int, default=100)
    p.add_argument("--dataset", default="random",
                   help="'random', 'mixed' (long and short prompts), or a .jsonl / .txt file of prompts")
    p.add_argument("--input-len", type=int, default=64, help="random dataset: prompt length; mixed: short ones (words)")
    p.add_argument("--long-len", type=int, default=1024, help="mixed dataset: long prompt length, words")
    p.add_argument("--long-fraction", type=float, default=0.25, help="mixed dataset: share of long prompts")
    p.add_argument("--output-len", type=int, default=64, help="max_tokens per request")
    p.add_argument("--range-ratio", type=float, default=0.0, help="random dataset: lengths vary by ±ratio")
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--no-ignore-eos", action="store_false", dest="ignore_eos",
                   help="let requests stop at EOS (default: exactly max_tokens tokens)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--warmup", type=int, default=1, help="requests sent (and not counted) first")
    p.add_argument("--slo-ttft-ms", type=float, default=None)
    p.add_argument("--slo-tpot-ms", type=float, default=None)
    p.add_argument("--slo-itl-ms", type=float, default=None, help="bound on a request's longest inter-token gap")
    p.add_argument("--slo-e2e-ms", type=float, default=None)
    p.add_argument("--json", default=None, metavar="PATH", help="also write the summary as JSON ('-' = stdout)")


def main(args: argparse.Namespace) -> dict[str, Any]:
    if args.concurrency is None and not math.isfinite(args.rate):
        print("note: neither --concurrency nor --rate given: all requests are sent at once", file=sys.stderr)
    if args.dataset == "random":
        specs = random_dataset(args.num_requests, args.input_len, args.output_len, args.range_ratio, args.seed)
    elif args.dataset == "mixed":
        specs = mixed_dataset(args.num_requests, args.input_len, args.long_len, args.long_fraction, args.output_len,
                              args.seed)
    else:
        specs = file_dataset(args.dataset, args.num_requests, args.output_len)
    s = benchmark(args.url, specs, args.slo_ttft_ms, args.slo_tpot_ms, args.slo_e2e_ms, args.slo_itl_ms,
                  model=args.model, concurrency=args.concurrency, rate=args.rate, seed=args.seed,
                  temperature=args.temperature, ignore_eos=args.ignore_eos, warmup=args.warmup)
    s["config"] = {k: v if not (isinstance(v, float) and math.isinf(v)) else "inf" for k, v in vars(args).items()
                   if k not in ("func",)}
    head = (f"bench serve {base_url(args.url)} model={s['model']} requests={args.num_requests} "
            f"concurrency={args.concurrency or '∞'} rate={args.rate:g}/s dataset={args.dataset}")
    if args.json != "-":
        print(head)
        print(format_table(s))
    if args.json:
        text = json.dumps(s, indent=2, default=str)
        if args.json == "-":
            print(text)
        else:
            Path(args.json).write_text(text)
    if not s["completed"]:  # nothing measured: a failed run, not a table of zeros
        raise TokenhaulError(f"all {s['failed']} requests failed: {'; '.join(s['errors']) or 'no error given'}")
    return s
