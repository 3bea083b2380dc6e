"""What the server itself counted: tokenhaul's /metrics (last-mile cost, prefix hits) and /ledger (per replica)."""

from __future__ import annotations

from typing import Any

import httpx

from tokenhaul.bench.loadgen.client import base_url
from tokenhaul.ledger.costs import prefix_miss_cost


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
        if b is None or _restarted(b, a):  # new, or restarted meanwhile: its ledger began again
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


def _restarted(before: dict[str, Any], after: dict[str, Any]) -> bool:
    """Whether a replica's ledger began again between two scrapes: it runs elsewhere now (`where` names its node and
    pid; an in-process core has none) or, the same pid again, any of its counters went down."""
    return before.get("where") != after.get("where") or any(before[k] > after[k] for k in _COUNTERS)


def _ledger_row(d: dict[str, int], kv_per_token: int) -> dict[str, Any]:
    prompt, cached = d["finished_prompt_tokens"], d["finished_cached_tokens"]
    return {"prefix_hit_rate": cached / prompt if prompt else None,
            "prompt_tokens_computed": d["prompt_tokens_computed"], "engine_steps": d["steps"],
            "recomputed_tokens": d["recomputed_tokens"],
            "prefix_miss": prefix_miss_cost(prompt - cached, kv_per_token, d["prefill_bytes"], d["prefill_flops"],
                                d["prefill_tokens"])}
