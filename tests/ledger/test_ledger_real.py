"""The ledger on the real default model (smollm2-135m): bytes against the ops actually run, stage
times against the wall time of `core.step()`, and the HTML report / trace with sane figures."""

from __future__ import annotations

import json
import re
import time
from html import escape

import pytest
from probe import TrafficCounter

from tokenhaul.ledger.findings import findings
from tokenhaul.ledger.ledger import STAGES, Ledger
from tokenhaul.ledger.perfetto import write_trace
from tokenhaul.ledger.report import write_report
from tokenhaul.models.catalog import is_installed
from tokenhaul.sampling_params import SamplingParams

pytestmark = [pytest.mark.real_model,
              pytest.mark.skipif(not is_installed("smollm2-135m"), reason="smollm2-135m not installed")]

GREEDY = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)


@pytest.fixture(autouse=True)
def one_thread():
    """One thread: two spinning OpenMP threads crawl when other jobs share the two cores."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture
def core(smollm):
    """The shared engine with a fresh ledger attached; left empty and unobserved afterwards."""
    core = smollm.core
    core.observer = Ledger(smollm.costs)
    yield core
    for rid in list(core.scheduler.requests):
        core.abort(rid)
    core.observer = None


def test_bytes_equal_ops_actually_run(core, smollm):
    core.add_request("bytes-a", smollm.encode("A ledger counts every byte that moves, from"), GREEDY)
    core.add_request("bytes-b", smollm.encode("Short one"), GREEDY)
    for _ in range(3):  # prefill of both, then two padded decode steps
        with TrafficCounter(core.model, core.kv) as tc:
            core.step()
        c = core.observer.steps[-1].costs
        assert c.weight_bytes == pytest.approx(tc.weight_bytes, rel=0.02)
        assert c.weight_bytes > 500e6  # all of SmolLM2's fp32 layers and lm_head
        assert c.kv_read_bytes == pytest.approx(tc.kv_read, rel=0.02)
        assert c.kv_write_bytes == pytest.approx(tc.kv_write, rel=0.02)
        assert c.flops == pytest.approx(tc.flops, rel=0.02)
    assert core.observer.steps[-1].costs.kv_pad_bytes > 0


def test_stage_times_sum_to_step_wall_time(core, smollm):
    core.add_request("wall", smollm.encode("Time every stage of"), SamplingParams(max_tokens=8, temperature=0))
    wall = 0.0
    while core.has_unfinished():
        t = time.perf_counter()
        core.step()
        wall += time.perf_counter() - t
    stages = sum(s.seconds for s in core.observer.steps)
    assert core.observer.num_steps >= 2
    assert stages == pytest.approx(wall, rel=0.05)


def test_report_figures_are_sane(smollm, tmp_path):
    from tokenhaul.whatif.calibrate import calibrate

    roof, _ = calibrate(root=tmp_path, nbytes=2**28)  # measured now, under the load of the run below
    prompts = ["The report on a real model says that", "Sanity first:"]
    t = time.perf_counter()
    outs = smollm.generate(prompts, SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))
    wall = time.perf_counter() - t
    ledger = outs[0].ledger
    s = ledger.summary(roof)

    def walk(v):
        return [x for y in v.values() for x in walk(y)] if isinstance(v, dict) else [v]

    assert all(x >= 0 for x in walk(s) if isinstance(x, float | int))
    assert s["generated_tokens"] == 16 == sum(len(o.token_ids) for o in outs)
    cached = sum(r.cached_tokens for r in ledger.requests)
    assert s["prompt_tokens"] + cached == sum(len(o.prompt_token_ids) for o in outs)
    accounted = sum(s["stage_seconds"][k] for k in STAGES) + s["between_steps_seconds"]
    assert 0.7 * wall < accounted <= wall
    assert s["decode_gb_per_s"] * 1e9 <= roof.bandwidth * 1.2
    assert s["decode"]["achieved_gflop_per_s"] * 1e9 <= roof.peak_flops * 1.2
    assert 0 < s["roofline_fraction"] <= 1.2 and 0 < s["data_wait_fraction"] <= 1.2
    assert s["weight_bytes_per_token"] == pytest.approx(ledger.costs.weight_bytes_per_step / 2, rel=0.01)
    fs = findings(ledger, roof)
    assert all(v >= 0 for f in fs for v in f.figures.values())
    assert sum(v for k, v in fs[3].figures.items() if k.endswith("_fraction") and k != "coordination_fraction") \
        == pytest.approx(1.0)
    html = write_report(ledger, tmp_path / "report.html", roof).read_text()
    assert html.count("data:image/png;base64,") == 4
    assert all(escape(f.question) in html for f in fs) and re.search(r"waiting on data \d+%", html)
    ev = json.loads(write_trace(ledger, tmp_path / "trace.json").read_text())["traceEvents"]
    assert sum(e.get("name") == "forward" for e in ev) == s["steps"]


def test_cli_trace(smollm, tmp_path, capsys, monkeypatch):
    import tokenhaul.llm
    from tokenhaul.cli import main

    monkeypatch.setattr(tokenhaul.llm, "LLM", lambda *a, **k: smollm)  # the session's engine: no reload
    main(["trace", "--prompt", "Trace me", "--concurrency", "2", "--max-tokens", "3", "--out", str(tmp_path)])
    out = capsys.readouterr().out
    assert "waiting on data" in out and "of ITL" in out
    assert (tmp_path / "report.html").stat().st_size > 10_000
    ev = json.loads((tmp_path / "trace.json").read_text())["traceEvents"]
    tracks = [(e["pid"], e["args"]["name"]) for e in ev if e["name"] == "thread_name"]
    assert (1, "forward") in tracks and sum(pid == 2 for pid, _ in tracks) == 2  # one track per request
