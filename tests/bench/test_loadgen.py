"""Load generator without a server: the mixed dataset and the summary (ITL max and p99/p50, the
ITL SLO, requests in flight)."""

from __future__ import annotations

import pytest

from tokenhaul.bench.loadgen import RequestResult, format_table, mixed_dataset, summarize


def test_mixed_dataset_is_seeded_and_mixes_long_and_short():
    a = mixed_dataset(200, short_len=20, long_len=400, long_fraction=0.25, output_len=8, seed=3)
    assert a == mixed_dataset(200, short_len=20, long_len=400, long_fraction=0.25, output_len=8, seed=3)
    words = [len(s.prompt.split()) for s in a]
    long = [w for w in words if w > 100]
    assert all(16 <= w <= 25 for w in words if w <= 100) and all(320 <= w <= 481 for w in long)
    assert [len(s.prompt.split()) > 100 for s in a] != [len(s.prompt.split()) > 100 for s in
                                                       mixed_dataset(200, 20, 400, 0.25, 8, seed=4)]  # seeded places
    assert len(long) == 50  # 25 % of 200
    assert len({s.prompt for s in a}) == 200 and all(s.max_tokens == 8 for s in a)


def test_summary_reports_itl_tail_and_judges_the_longest_gap():
    smooth = RequestResult(ok=True, ttft=0.1, e2e=1.0, itls=[0.1] * 9, output_tokens=10)
    stalled = RequestResult(ok=True, ttft=0.1, e2e=1.3, itls=[0.1] * 8 + [0.4], output_tokens=10)
    s = summarize([smooth, stalled], wall_s=2.0, slo_ttft_ms=500, slo_itl_ms=200)
    assert s["itl_ms"]["max"] == pytest.approx(400) and s["itl_ms"]["p50"] == pytest.approx(100)
    assert s["itl_p99_over_p50"] == pytest.approx(s["itl_ms"]["p99"] / 100) and s["itl_p99_over_p50"] > 3
    assert s["good_requests"] == 1 and s["goodput"] == pytest.approx(0.5)
    assert s["mean_in_flight"] == pytest.approx(2.3 / 2.0)
    table = format_table(s)
    assert "ITL p99/p50" in table and "itl≤200ms" in table and "max" in table
    assert summarize([stalled], 2.0, slo_itl_ms=400)["good_requests"] == 1


@pytest.mark.parametrize("extra", [[], ["--model", "x"]])
def test_bench_serve_without_a_server_is_one_error_line_and_fails(capsys, extra):
    """No server at --url: a one-line error and a non-zero exit, not a traceback (model lookup) or a table of zeros
    that exits 0 (every request failed)."""
    from tokenhaul.cli import main

    with pytest.raises(SystemExit) as e:
        main(["bench", "serve", "--url", "http://127.0.0.1:9", "--num-requests", "2", "--output-len", "4", *extra])
    assert e.value.code not in (0, None)
    err = capsys.readouterr().err
    assert "Traceback" not in err and ("cannot reach" in err or "requests failed" in err)


def _ledger(where: str, steps: int, computed: int, **kw: int) -> dict:
    from tokenhaul.bench.loadgen.scrape import _COUNTERS

    rep = dict.fromkeys(_COUNTERS, 0) | {"steps": steps, "prompt_tokens_computed": computed,
                                        "kv_bytes_per_token": 100, "where": where} | kw
    return {"replicas": {"0": rep}, "routing": {}}


@pytest.mark.parametrize("after", [
    _ledger("node a pid 2", 168, 110),  # restarted (another pid), and stepped past the count before
    _ledger("node a pid 1", 168, 110),  # the same pid again: a counter that went down still tells
], ids=["new-pid", "counter-down"])
def test_ledger_figures_count_a_restarted_replica_from_zero(after):
    """A replica restarted between the scrapes: its ledger began again, so its figures are its new ledger's, never
    a negative difference (computed -690) with the old one's."""
    from tokenhaul.bench.loadgen import ledger_figures

    per, total = ledger_figures(_ledger("node a pid 1", 3, 800, finished_prompt_tokens=900), after)
    assert per["0"]["prompt_tokens_computed"] == total["prompt_tokens_computed"] == 110
    assert per["0"]["engine_steps"] == 168 and per["0"]["prefix_hit_rate"] is None
    same = ledger_figures(_ledger("node a pid 1", 3, 80), _ledger("node a pid 1", 168, 110))[1]
    assert same["prompt_tokens_computed"] == 30 and same["engine_steps"] == 165


def test_bench_serve_scrapes_the_server_after_the_warmup(monkeypatch):
    """The server-side figures (ledger, last mile) leave the warmup requests out, as --warmup says: the "before"
    scrapes come after the warmup, the "after" ones after the measured requests."""
    from tokenhaul.bench.loadgen import client, run
    from tokenhaul.bench.loadgen.datasets import PromptSpec

    events = []

    async def one(c, url, body):
        events.append(f"request {body['max_tokens']}")
        return RequestResult(ok=True, e2e=0.1, ttft=0.05, output_tokens=1)

    async def scrape(url):
        events.append("scrape")

    monkeypatch.setattr(client, "_one", one)
    monkeypatch.setattr(run, "scrape_last_mile", scrape)
    monkeypatch.setattr(run, "scrape_ledger", scrape)
    specs = [PromptSpec(f"p{i}", 16) for i in range(3)]
    run.benchmark("http://127.0.0.1:9", specs, model="m", warmup=2)
    assert events == ["request 4"] * 2 + ["scrape"] * 2 + ["request 16"] * 3 + ["scrape"] * 2

