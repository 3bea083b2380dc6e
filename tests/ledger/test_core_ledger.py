"""CoreLedger: a serving core's ledger read from another thread — totals, the cost of prefix-cache
misses (from ledger/costs.py), and step records after a given step."""

from __future__ import annotations

import json

from tokenhaul.ledger.core_ledger import CoreLedger
from tokenhaul.sampling_params import SamplingParams


def test_snapshot_counts_prefix_misses_and_names_steps(ledger_core):
    core, led = ledger_core()
    cl = core.observer = CoreLedger(led.costs)
    params = SamplingParams(max_tokens=3, temperature=0, ignore_eos=True)
    shared = list(range(1, 17))  # 4 full blocks of 4
    core.add_request("a", shared + [20, 21], params)
    while core.has_unfinished():
        core.step()
    first = cl.snapshot(since=-1)
    core.add_request("b", shared + [30, 31], params)  # after a finished: its 4 blocks are cached
    while core.has_unfinished():
        core.step()
    s = cl.snapshot(since=first["last_step"])
    assert s["steps"] == core.num_steps and s["generated_tokens"] == 6
    assert s["decode_tokens"] == 4  # the tokens decode_tokens_per_s counts: not the first, sampled at prefill
    assert (s["finished_prompt_tokens"], s["finished_cached_tokens"]) == (36, 16)
    miss = s["prefix_miss"]
    assert miss["tokens"] == 20 and miss["kv_bytes"] == 20 * led.costs.kv_bytes_per_token
    assert miss["bytes_moved"] > miss["kv_bytes"] and miss["flops"] > 0
    assert s["prompt_tokens_computed"] == 20  # the 16 cached tokens of b were not computed
    records = s["step_records"]
    assert [r["index"] for r in records] == list(range(first["last_step"] + 1, core.num_steps))
    assert records[0]["chunks"][0][0] == "b" and all(r["bytes"] > 0 for r in records)
    assert s["ttft_ms"]["n"] == 2 and s["itl_ms"]["n"] == 4  # core side: 3 tokens each, 2 gaps each
    json.dumps(s)  # plain data: crosses a Ray actor boundary and goes out as JSON
    assert cl.snapshot()["step_records"] == []
