"""One benchmark: warm up, scrape the server, run the load, summarize, scrape again and add what the server counted."""

from __future__ import annotations

import asyncio
from typing import Any

from tokenhaul.bench.loadgen.client import run_load
from tokenhaul.bench.loadgen.datasets import PromptSpec
from tokenhaul.bench.loadgen.scrape import ledger_figures, scrape_last_mile, scrape_ledger
from tokenhaul.bench.loadgen.summary import summarize


def benchmark(url: str, specs: list[PromptSpec], slo_ttft_ms: float | None = None,
              slo_tpot_ms: float | None = None, slo_e2e_ms: float | None = None, slo_itl_ms: float | None = None,
              **kw: Any) -> dict[str, Any]:
    """Run the load and summarize (blocking); kw go to run_load."""

    async def go() -> dict[str, Any]:
        before = led0 = None

        async def scrape_before() -> None:  # after the warmup, which is not counted
            nonlocal before, led0
            before, led0 = await scrape_last_mile(url), await scrape_ledger(url)

        results, wall, model = await run_load(url, specs, after_warmup=scrape_before, **kw)
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
