"""The ledger on tiny random engines: bounded memory, recompute accounting, never steering, summary,
findings, Perfetto trace, calibration cache. Fast: no real model, no measurement."""

from __future__ import annotations

import ast
import json
import os
import re
from pathlib import Path

import pytest
import torch

from tokenhaul.ledger.findings import findings, four_costs, moved, stage_shares
from tokenhaul.ledger.ledger import Ledger, percentile
from tokenhaul.ledger.perfetto import trace_events, write_trace
from tokenhaul.ledger.report import text_report
from tokenhaul.sampling_params import SamplingParams
from tokenhaul.whatif.roofline import Roofline

ROOF = Roofline(20e9, 100e9, "test machine")
GREEDY = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)


def run(core, ledger, n_requests, length=9, params=GREEDY):
    """Drive the core like LLM.generate does, reporting each delivered token to the ledger."""
    for i in range(n_requests):
        core.add_request(f"r{i}", [(5 * i + j) % 90 + 1 for j in range(length + i % 3)], params)
    out = {}
    while core.has_unfinished():
        step = core.num_steps
        for d in core.step():
            out.setdefault(d.request_id, []).extend(d.new_token_ids)
            if ledger is not None:
                ledger.on_token(d.request_id, step, 1e-5, 1e-6)
    return out


def test_bounded_memory(ledger_core):
    core, _ = ledger_core()
    ledger = core.observer = Ledger(core.observer.costs, max_steps=4, max_tokens=32, max_requests=4)
    run(core, ledger, 12)
    assert ledger.num_steps == 10 and len(ledger.steps) == 4
    assert ledger.num_tokens == 120 and len(ledger.tokens) == 32 and len(ledger.itl) == 32
    assert len(ledger.requests) == 4
    assert not ledger._live and len(ledger._closing) <= 256
    s = ledger.summary(ROOF)
    assert s["generated_tokens"] == 120 and s["steps"] == ledger.num_steps


def test_preemption_recompute_counted(ledger_core):
    core, ledger = ledger_core(num_kv_blocks=14, block_size=4, enable_prefix_caching=False)
    params = SamplingParams(max_tokens=14, temperature=0, ignore_eos=True)
    run(core, ledger, 4, params=params)
    assert core.scheduler.num_preemptions > 0
    assert ledger.num_preemptions == core.scheduler.num_preemptions
    computed = ledger.prefill.tokens + ledger.decode.tokens
    needed = sum(9 + i % 3 + 14 - 1 for i in range(4))  # each position once; the last token is never fed
    assert ledger.recomputed_tokens == computed - needed > 0
    assert ledger.prompt_tokens == sum(9 + i % 3 for i in range(4))
    assert sum(r.recomputed for r in ledger.requests) == ledger.recomputed_tokens
    c = four_costs(ledger, ROOF)
    assert c["rollback_tokens"] > 0 and c["rollback_s"] > 0


def test_observer_never_steers(ledger_core):
    core, ledger = ledger_core()
    with_ledger = run(core, ledger, 5)
    core, _ = ledger_core()
    core.observer = None
    assert run(core, None, 5) == with_ledger


def test_engine_never_reads_the_ledger():
    root = Path(__file__).resolve().parents[2] / "tokenhaul"
    for room in ("engine", "kv", "models", "layers", "decoding"):
        for f in (root / room).glob("*.py"):
            assert not re.search(r"^\s*(from|import) tokenhaul\.(ledger|whatif)", f.read_text(), re.M), f


def test_ledger_never_imports_whatif_at_run_time():
    """The what-if model reads ledgers and costs; the ledger is handed a roofline (no import circle)."""
    root = Path(__file__).resolve().parents[2] / "tokenhaul" / "ledger"
    for f in root.glob("*.py"):
        tree = ast.parse(f.read_text())
        guarded = {id(n) for node in ast.walk(tree) if isinstance(node, ast.If)
                   and getattr(node.test, "id", "") == "TYPE_CHECKING" for n in ast.walk(node)}
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom | ast.Import) and id(node) not in guarded:
                names = [node.module or ""] if isinstance(node, ast.ImportFrom) else [a.name for a in node.names]
                assert not any(n.startswith("tokenhaul.whatif") for n in names), f


def test_summary_and_findings(ledger_core):
    core, ledger = ledger_core()
    run(core, ledger, 3)
    s = ledger.summary(ROOF)
    for k in ("weight_bytes_per_token", "kv_bytes_per_token", "prefill_tokens_per_s", "decode_tokens_per_s",
              "stage_seconds", "roofline_fraction"):
        assert k in s
    assert set(s["stage_seconds"]) >= {"schedule", "prepare", "forward", "sample", "update", "detokenize",
                                       "deliver"}
    assert all(v >= 0 for v in s["stage_seconds"].values())
    assert s["weight_bytes_per_token"] > 0 and 0 < s["roofline_fraction"]
    assert s["generated_tokens"] == 30 and s["itl_ms"]["n"] == 27 and s["ttft_ms"]["n"] == 3
    assert s["prompt_tokens"] == 9 + 10 + 11
    fs = findings(ledger, ROOF)
    assert len(fs) == 5 and all(f.answer for f in fs)
    assert all(v >= 0 for f in fs for v in f.figures.values())
    assert sum(stage_shares(ledger).values()) > 0
    assert "waiting on data" in fs[0].answer and "of ITL" in fs[2].answer
    assert text_report(ledger, ROOF).count("\n") >= 10
    # the wait policy the engine ran under (tokenhaul/__init__.py or the environment) is on record
    wait = os.environ.get("GOMP_SPINCOUNT") and f"GOMP_SPINCOUNT={os.environ['GOMP_SPINCOUNT']}"
    wait = wait or f"OMP_WAIT_POLICY={os.environ.get('OMP_WAIT_POLICY', 'unset')}"
    assert s["host"] == {"threads": torch.get_num_threads(), "openmp_wait": wait}
    assert f"OpenMP wait {wait}" in text_report(ledger, ROOF)


def test_moved():
    a = dict(compute_flops=1e9, memory_bytes=5e8, sync_s=1e-3, rollback_tokens=0.0)
    b = dict(compute_flops=1e9, memory_bytes=1.25e8, sync_s=1.01e-3, rollback_tokens=0.0)
    assert moved(a, b) == {"memory_bytes": -0.75}


def test_perfetto_trace(ledger_core, tmp_path):
    core, ledger = ledger_core()
    run(core, ledger, 2)
    path = write_trace(ledger, tmp_path / "t" / "trace.json")
    ev = json.loads(path.read_text())["traceEvents"]
    names = {e["args"]["name"] for e in ev if e["ph"] == "M" and e["name"] == "thread_name"}
    assert {"schedule", "forward", "detokenize", "deliver", "r0", "r1"} <= names
    spans = [e for e in ev if e["ph"] == "X"]
    assert all(e["dur"] >= 0 and e["ts"] >= 0 for e in spans)
    assert sum(e["name"] == "forward" for e in spans) == ledger.num_steps
    counters = {e["name"] for e in ev if e["ph"] == "C"}
    assert counters == {"KV blocks", "bytes per step (MB)"}
    assert sum(e["name"] == "token" for e in ev) == 20
    assert trace_events(ledger) == ev


def test_percentile():
    assert percentile([], 99) == 0.0
    assert percentile(range(1, 101), 50) == 50 and percentile(range(1, 101), 99) == 99
    assert percentile([3.0], 99) == 3.0


def test_calibration_cached(tmp_path, monkeypatch):
    from tokenhaul.whatif import calibrate as cal

    roof, entry = cal.calibrate(root=tmp_path, nbytes=2**24, gemm_n=128)
    assert roof.bandwidth > 0 and roof.peak_flops > 0 and entry["threads"] >= 1
    table = json.loads(cal.calibration_path(tmp_path).read_text())
    assert list(table) == [cal.machine_key("cpu")] == [roof.key]
    cal._memo.clear()
    monkeypatch.setattr(cal, "measure", lambda *a, **k: pytest.fail("measured again"))
    assert cal.machine_roofline("cpu", tmp_path) == roof
    assert roof.position(roof.bandwidth, 0, 1.0).roofline_fraction == pytest.approx(1.0)


def test_empty_ledger_reads_cleanly(ledger_core):
    from tokenhaul.ledger.report import html_report

    _, ledger = ledger_core()
    assert ledger.summary(ROOF)["roofline_fraction"] == 0.0
    assert len(findings(ledger, ROOF)) == 5 and "<html>" in html_report(ledger, ROOF)


def test_roofline_follows_a_working_set_that_fits_the_cache(ledger_core):
    """Weights that fit the buffer calibrated in the last-level cache are read at that bandwidth, so a small model
    on a big-cache host is not put above 100 % of a DRAM roofline; bigger ones keep the DRAM roofline."""
    roof = Roofline(20e9, 100e9, "m", resident_bytes=64e6, resident_bandwidth=80e9)
    assert roof.for_working_set(10e6).bandwidth == 80e9 and "last-level cache" in roof.for_working_set(10e6).key
    assert roof.for_working_set(65e6) is roof and ROOF.for_working_set(1e6) is ROOF
    assert Roofline(20e9, 1e11, "m", 64e6, 10e9).for_working_set(1e6).bandwidth == 20e9  # never below DRAM's
    core, _ = ledger_core()
    weights = core.observer.costs.weight_bytes_per_step
    for fits, bw in ((True, 80e9), (False, 20e9)):
        r = Roofline(20e9, 100e9, "m", weights * (2 if fits else 0.5), 80e9)
        ledger = core.observer = Ledger(core.observer.costs, roofline=lambda r=r: r)
        run(core, ledger, 2)
        assert ledger.roofline().bandwidth == bw
        assert ledger.summary()["roofline_fraction"] == pytest.approx(ledger.decode.position(ledger.roofline())
                                                                      .roofline_fraction)


def test_calibration_measures_a_cache_resident_pass(monkeypatch):
    from tokenhaul.whatif import calibrate

    monkeypatch.setattr(calibrate, "llc_bytes", lambda: 8 << 20)
    monkeypatch.setattr(calibrate, "measure_flops", lambda *a, **k: 1e11)
    entry = calibrate.measure(nbytes=64 << 20)
    assert entry["resident_bytes"] == 4 << 20 and entry["resident_gb_per_s"] > 0
    roof = calibrate._roofline("k", entry)
    assert roof.resident_bytes == 4 << 20 and roof.resident_bandwidth == entry["resident_gb_per_s"] * 1e9


def test_decode_count_and_rate_cover_the_same_tokens(ledger_core):
    """The headline's decode figure counts the tokens its rate divides (those of decode steps); the first
    tokens, sampled in prefill steps, are in the total generated, not in the decode count."""
    core, ledger = ledger_core()
    run(core, ledger, 3)
    s = ledger.summary(ROOF)
    assert s["generated_tokens"] == 30 and s["decode_tokens"] == ledger.decode.sampled == 27
    assert s["decode_tokens_per_s"] == pytest.approx(27 / ledger.decode.seconds)
    line = ledger.short_line(ROOF)
    assert f"30 tok generated: 27 in decode steps @ {s['decode_tokens_per_s']:.1f} tok/s" in line
    assert "of roofline" in line and "waiting on data" in line


def test_prefill_count_and_rate_cover_the_same_tokens(ledger_core):
    """The headline's prefill rate divides every token of prefill steps; where those steps computed more than the
    prompts (a decode beside a prompt chunk) the line names both counts, so the rate is not read as the prompts'."""
    core, ledger = ledger_core(max_num_batched_tokens=8)
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    core.add_request("a", list(range(1, 4)), params)
    core.step()
    core.add_request("b", list(range(10, 30)), params)  # chunked beside a's decodes
    while core.has_unfinished():
        core.step()
    s = ledger.summary(ROOF)
    assert s["prompt_tokens"] == 23 < s["prefill_computed_tokens"] == ledger.prefill.tokens
    assert s["prefill_tokens_per_s"] == pytest.approx(ledger.prefill.tokens / ledger.prefill.seconds)
    line = ledger.short_line(ROOF)
    assert line.startswith(f"prefill 23 prompt tok ({ledger.prefill.tokens} computed in prefill steps @ "), line


def test_no_decode_figures_without_decode_steps(ledger_core):
    """max_tokens 1: every token is sampled in a prefill step; the line shows no decode rate, bytes per token,
    roofline or data wait (the prefill's were shown as if they were decode's)."""
    core, ledger = ledger_core()
    run(core, ledger, 2, params=SamplingParams(max_tokens=1, temperature=0, ignore_eos=True))
    assert ledger.decode.steps == 0
    line = ledger.short_line(ROOF)
    assert "2 tok generated, no decode steps" in line
    assert "tok/s |" not in line.split("|", 1)[1]
    for figure in ("roofline", "waiting on data", "per token", "GB/s"):
        assert figure not in line, line


def test_kv_blocks_peak_counts_steps_whose_requests_finish(ledger_core):
    """A step's record counted the blocks left after finished requests freed theirs: with max_tokens 1 every
    request finishes in its prefill step and the peak read 0. Now it counts the blocks held through the step
    (prompts of 9 and 10 tokens in blocks of 4: 3 + 3), blocks shared through the prefix cache once."""
    core, ledger = ledger_core()
    run(core, ledger, 2, params=SamplingParams(max_tokens=1, temperature=0, ignore_eos=True))
    assert core.pool.num_used == 0 and ledger.kv_blocks_peak == 6
    core, ledger = ledger_core()  # b shares a's 4 cached prompt blocks and finishes in the step it joins
    shared = list(range(1, 17))
    core.add_request("a", shared + [20], SamplingParams(max_tokens=4))
    core.step()
    core.add_request("b", shared + [30], SamplingParams(max_tokens=1))
    while core.has_unfinished():
        core.step()
    assert ledger.steps[1].record.chunks == [("a", 17, 1), ("b", 16, 1)]
    assert ledger.kv_blocks_peak == 6  # a's 5 blocks and b's own fifth, the shared 4 counted once


def test_perfetto_names_chunks_by_the_prompt(ledger_core):
    """A 1-token prompt's prefill chunk is 'prefill 0:1', not 'decode @0': a chunk is named by whether it
    computes prompt positions (ledger.computes_prompt, as on_step judged it), not by its length."""
    core, ledger = ledger_core()
    params = SamplingParams(max_tokens=3, temperature=0, ignore_eos=True)
    core.add_request("long", list(range(1, 12)), params)
    core.add_request("hi", [7], params)

    def chunks(rid):
        return [e["name"] for e in trace_events(ledger) if e["ph"] == "X" and e["pid"] == 2 and
                e["tid"] == tids[rid] and e["name"] != "queued"]

    core.step()
    tids = {e["args"]["name"]: e["tid"] for e in trace_events(ledger) if e.get("name") == "thread_name"
            and e["pid"] == 2}
    assert chunks("hi") == ["prefill 0:1"] and chunks("long") == ["prefill 0:11"]  # running: none finished
    while core.has_unfinished():
        core.step()
    assert chunks("hi") == ["prefill 0:1", "decode @1", "decode @2"]
    assert chunks("long") == ["prefill 0:11", "decode @11", "decode @12"]


def test_a_prompt_chunk_of_one_token_is_prefill(ledger_core):
    """A step computing prompt positions is a prefill step whatever its chunks' lengths: a 1-token prompt
    with max_tokens 1 (was 0 prefill steps and 1 decode step, whose line showed the prefill's rate, roofline
    and data wait as decode's), and a 9-token prompt chunked 8 + 1 (its last chunk counted as decode).
    Every step's phase agrees with the Perfetto trace's names for its chunks."""
    one = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)
    for prompt, budget, prefill_steps in (([7], 512, 1), (list(range(1, 10)), 8, 2)):
        core, ledger = ledger_core(max_num_batched_tokens=budget)
        core.add_request("r", prompt, one)
        while core.has_unfinished():
            core.step()
        assert (ledger.prefill.steps, ledger.decode.steps) == (prefill_steps, 0)
        assert ledger.prompt_tokens == len(prompt)
        line = ledger.short_line(ROOF)
        assert f"prefill {len(prompt)} tok @" in line and "1 tok generated, no decode steps" in line, line
        for figure in ("roofline", "waiting on data", "per token", "GB/s"):
            assert figure not in line, line
        names = [e["name"] for e in trace_events(ledger) if e["ph"] == "X" and e["pid"] == 2 and e["name"] != "queued"]
        assert names == [f"prefill {s}:{s + n}" for step in ledger.steps for _, s, n in step.record.chunks]
    # with decode steps too: every step is prefill exactly when Perfetto names one of its chunks 'prefill'
    core, ledger = ledger_core(max_num_batched_tokens=8)
    run(core, ledger, 3, params=SamplingParams(max_tokens=3, temperature=0, ignore_eos=True))
    assert any(s.is_prefill and all(n == 1 for *_, n in s.record.chunks) for s in ledger.steps)
    ev = [e for e in trace_events(ledger) if e["ph"] == "X" and e["pid"] == 2 and e["name"] != "queued"]
    for s in ledger.steps:
        named = {e["name"].split()[0] for e in ev if e["args"]["step"] == s.record.index}
        assert s.is_prefill == ("prefill" in named), (s.record.chunks, named)
    assert ledger.prefill.steps + ledger.decode.steps == ledger.num_steps
