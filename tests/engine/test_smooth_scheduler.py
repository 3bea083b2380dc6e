"""The inter-token budget on a tiny model: decodes get a token every step under a flood of long
prompts, no prompt starves, priority first, the same greedy output as without a budget, and each
step records its budget and prediction.

The step-time model here has fixed coefficients and no online refinement (alpha 0), so the chunk
sizes, and with them these tests, do not depend on how fast the machine is at the moment."""

from __future__ import annotations

import dataclasses
import json

import pytest
from drive import run_requests
from tiny_models import tiny_model

from tokenhaul.config import EngineConfig
from tokenhaul.engine.core import EngineCore
from tokenhaul.engine.step_time import StepTimeModel, default_knots
from tokenhaul.ledger.costs import ModelCosts
from tokenhaul.ledger.ledger import Ledger
from tokenhaul.ledger.perfetto import write_trace
from tokenhaul.sampling_params import SamplingParams

CAP = 64
# 2 ms a step + 0.1 ms a token; attention and sampling free: a budget buys a known number of tokens
MODEL = StepTimeModel(default_knots(CAP), [2e-3 + 1e-4 * k for k in default_knots(CAP)], [0.0] * 4, alpha=0.0)


class Steps:
    """An observer keeping every StepRecord."""

    def __init__(self) -> None:
        self.records = []

    def on_step(self, record) -> None:
        self.records.append(record)

    def on_finish(self, request) -> None:
        pass


def smooth_core(itl_target_ms: float, **kw) -> EngineCore:
    cfg = EngineConfig(model="tiny", dtype="fp32", num_kv_blocks=1024, block_size=4, max_num_batched_tokens=CAP,
                       max_num_seqs=32, itl_target_ms=itl_target_ms, **kw)
    return EngineCore(cfg, tiny_model(), Steps(), step_time=StepTimeModel.from_dict(MODEL.to_dict(), alpha=0.0))


def prompt(i: int, n: int) -> list[int]:
    return [(7 * i + 3 * t) % 96 + 1 for t in range(n)]


def in_decode(core: EngineCore) -> set[str]:
    return {r.request_id for r in core.scheduler.running if r.num_computed_tokens >= r.num_tokens - 1}


def test_decodes_get_a_token_every_step_under_a_flood_of_long_prompts():
    core = smooth_core(itl_target_ms=3.0)  # 2 ms + 10 tokens a step, or 1.5x the decodes' time
    params = SamplingParams(max_tokens=30, temperature=0, ignore_eos=True)
    for i in range(4):
        core.add_request(f"chat{i}", prompt(i, 6), params)
    core.step()  # no decode yet, so no bound: all four prompts in one step
    assert in_decode(core) == {f"chat{i}" for i in range(4)}
    for i in range(8):
        core.add_request(f"long{i}", prompt(100 + i, 150), SamplingParams(max_tokens=4, temperature=0))
    budgets = []
    while core.has_unfinished():
        decoding = in_decode(core)
        # the target, or 1.5x the decodes' predicted time if more (prefill keeps a share); none without decodes
        budgets.append(max(0.003, 1.5 * (2e-3 + 1e-4 * len(decoding))) if decoding else 0.0)
        got = {d.request_id for d in core.step() if d.new_token_ids}
        assert decoding <= got, decoding - got
    assert [r.budget_s for r in core.observer.records[-len(budgets):]] == pytest.approx(budgets)
    assert max(budgets) > 0.0035  # the decodes made the budget grow past the 3 ms target
    mixed = [r for r in core.observer.records if any(n == 1 for *_, n in r.chunks) and any(n > 1 for *_, n in r.chunks)]
    assert len(mixed) > 20  # the long prompts really did run alongside the decodes


def test_steps_keep_to_budget_and_cap_and_record_them_and_output_is_unchanged(tiny_core):
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    prompts = [prompt(i, 9 + 37 * (i % 3)) for i in range(9)]
    ref = run_requests(tiny_core(num_kv_blocks=1024, max_num_batched_tokens=CAP), prompts, params)
    core = smooth_core(itl_target_ms=3.0)  # 2 ms + 10 tokens a step
    assert run_requests(core, prompts, params) == ref
    records = core.observer.records
    assert len(records) > len(ref[0]) + 10
    for r in records:
        tokens = sum(n for *_, n in r.chunks)
        prefill = [n for *_, n in r.chunks if n > 1]
        decodes = len(r.chunks) - len(prefill)
        assert r.budget_s >= 0.003 if decodes else r.budget_s == 0  # no decode waiting: no bound
        assert r.predicted_s == pytest.approx(2e-3 + 1e-4 * tokens)
        assert tokens <= CAP
        if decodes:
            assert r.predicted_s <= r.budget_s + 1e-12 or len(prefill) == 1  # over only by the one forced chunk
    assert core.scheduler.step_time.scale == 1.0  # alpha 0: the model stayed as given


def test_trace_shows_budget_predicted_and_measured_per_step(tmp_path):
    core = smooth_core(itl_target_ms=3.0)
    core.observer = ledger = Ledger(ModelCosts.from_model(core.model, 4))
    run_requests(core, [prompt(1, 40), prompt(2, 5)], SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))
    ev = json.loads(write_trace(ledger, tmp_path / "trace.json").read_text())["traceEvents"]
    counters = [e for e in ev if e["ph"] == "C" and e["name"] == "step time (ms)"]
    assert len(counters) == ledger.num_steps > 5
    for e, step in zip(counters, ledger.steps):
        r = step.record
        assert e["args"]["budget"] == pytest.approx(r.budget_s * 1e3)
        assert e["args"]["budget"] >= 3.0 or not any(n == 1 for *_, n in r.chunks)  # 0: no decode, no bound
        assert e["args"]["predicted"] == pytest.approx(r.predicted_s * 1e3) and r.predicted_s > 0
        measured = r.stage_seconds["prepare"] + r.stage_seconds["forward"] + r.stage_seconds["sample"]
        assert e["args"]["measured"] == pytest.approx(measured * 1e3) and measured > 0


def test_the_core_refines_the_model_from_the_steps_it_times():
    core = smooth_core(itl_target_ms=3.0)
    core.scheduler.step_time.alpha = 0.5
    run_requests(core, [prompt(1, 40)], SamplingParams(max_tokens=3, temperature=0, ignore_eos=True))
    assert core.scheduler.step_time.num_observed == len(core.observer.records)
    assert core.scheduler.step_time.scale != 1.0


def test_no_prompt_starves_when_decodes_alone_fill_the_budget():
    """A budget below what the decodes alone take, and no headroom over them: prefill still moves
    min_prefill_chunk (16) tokens a step, first come first served, so prompt i finishes within the
    steps its predecessors need."""
    core = smooth_core(itl_target_ms=1.0)
    core.scheduler.config = dataclasses.replace(core.scheduler.config, decode_headroom=1.0)
    chat = SamplingParams(max_tokens=200, temperature=0, ignore_eos=True)
    for i in range(3):
        core.add_request(f"chat{i}", prompt(i, 5), chat)
    while len(in_decode(core)) < 3:
        core.step()
    lengths = [120, 64, 200, 33, 150]
    for i, n in enumerate(lengths):
        core.add_request(f"long{i}", prompt(50 + i, n), SamplingParams(max_tokens=2, temperature=0, ignore_eos=True))
    finished: dict[str, int] = {}
    step = 0
    while any(f"long{i}" not in finished for i in range(len(lengths))):
        step += 1
        for d in core.step():
            if d.finished:
                finished[d.request_id] = step
    bound = 0
    for i, n in enumerate(lengths):
        bound += -(-n // 16)
        assert finished[f"long{i}"] <= bound + 2, (i, finished, bound)  # its chunks, then two tokens


def test_higher_priority_prefills_first():
    core = smooth_core(itl_target_ms=1.0)  # one forced 16-token chunk a step
    params = SamplingParams(max_tokens=1, temperature=0)
    core.add_request("low", prompt(1, 96), params, priority=5)
    core.add_request("high", prompt(2, 96), params, priority=0)
    order = []
    while core.has_unfinished():
        order += [d.request_id for d in core.step() if d.finished]
    assert order == ["high", "low"]
