"""The analytic model on hand-computed cases: a pure-bandwidth GEMV, a compute-bound GEMM, a model that
spills SRAM, and PIM where attention never crosses the memory bus. One model, numbers worked out below:

hidden 1024, 1 layer, 8 heads × 128 (no GQA), FFN 4096, vocab 1000, tied embeddings, bf16 weights.
  layer params: attention 4 × 1024² = 4,194,304; FFN 3 × 1024 × 4096 = 12,582,912; sum 2^24 = 16,777,216
  layer bytes 2^25 = 33,554,432; lm_head 1024 × 1000 × 2 = 2,048,000; norms (2 + 1) × 1024 × 4 = 12,288;
  one embedding row 2,048; KV per token 2 × 1024 × 2 = 4,096 bytes."""

from __future__ import annotations

import pytest

from tokenhaul.errors import TokenhaulError
from tokenhaul.models.config import ModelConfig
from tokenhaul.whatif.hardware import PIM, Hardware, Tier
from tokenhaul.whatif.model import StepModel, place
from tokenhaul.whatif.workload import Decoding, Workload, predict

CFG = ModelConfig("llama", 1024, 1, 8, 8, 128, 4096, 1000, 8192, 1e-5, 1e4, True)
LAYER, HEAD, NORMS, ROW, KV = 33_554_432, 2_048_000, 12_288, 2_048, 4_096
HUGE = 1e30


def hw(tiers, flops=HUGE, **kw) -> Hardware:
    return Hardware("test", "test", tuple(tiers), {"bf16": flops, "attention": flops},
                    activation_bandwidth=HUGE, **kw)


def model(h: Hardware, kv_tokens: int = 16) -> StepModel:
    w = Workload("t", CFG)
    mc = w.costs()
    assert (mc.layer_weight_bytes, mc.lm_head_bytes, mc.norm_bytes, mc.kv_bytes_per_token) == (LAYER, HEAD, NORMS, KV)
    return StepModel(h, mc, "bf16", place(h, mc.weight_bytes_per_step, kv_tokens * KV))


def test_pure_bandwidth_gemv():
    """One decode token at position 0: every weight byte read once at 100 GB/s; K/V: one 16-slot block
    read, one token written. FLOPs are free, so time = bytes / bandwidth exactly."""
    st = model(hw([Tier("DRAM", 1e12, 100e9)])).step([(0, 1)], 1)
    weights = LAYER + HEAD + NORMS + ROW  # 35,616,768
    kv = 16 * KV + KV  # 69,632
    assert st.bus_bytes == {"DRAM": weights + kv}
    assert st.parts == {"memory:DRAM": pytest.approx((weights + kv) / 100e9), "memory:activations": pytest.approx(0),
                        "overhead": 0.0}
    assert st.seconds == pytest.approx(356.86400e-6) and st.bound == "memory:DRAM"


def test_compute_bound_gemm():
    """A 4096-token prefill at 1 TFLOP/s: linears 2 × 4096 × 2^24, lm_head 2 × 1024 × 1000 for the one
    sampled row, attention 4 × 4096 × 4096 keys × 8 heads × 128; bytes (≈ 70 MB) take 70 µs at 1 TB/s."""
    st = model(hw([Tier("HBM", 1e12, 1e12)], flops=1e12), kv_tokens=4096).step([(0, 4096)], 1)
    flops = 2 * 4096 * 2**24 + 2 * 1024 * 1000 + 4 * 4096 * 4096 * 8 * 128
    assert flops == 206_160_478_208 and st.flops == flops
    assert st.parts["compute"] == pytest.approx(0.206160478208) and st.bound == "compute"
    assert "memory:HBM" not in st.parts  # each op was compute-bound


def test_model_that_spills_sram():
    """20 MB of SRAM at 10 TB/s before 100 GB/s DRAM: 20 MB of the 35,614,720 resident weight bytes sit
    in SRAM, the rest and all KV spill; the DRAM part binds. With 64 MB of SRAM everything fits."""
    resident = LAYER + HEAD + NORMS
    small = model(hw([Tier("SRAM", 20e6, 10e12), Tier("DRAM", 1e12, 100e9)]))
    assert small.placement.weight_share == pytest.approx({"SRAM": 20e6 / resident, "DRAM": 1 - 20e6 / resident})
    assert small.placement.kv_share == {"DRAM": 1.0}
    st = small.step([(0, 1)], 1)
    dram = (LAYER + NORMS + ROW) * (1 - 20e6 / resident) + HEAD * (1 - 20e6 / resident) + 17 * KV
    assert st.parts["memory:DRAM"] == pytest.approx(dram / 100e9) and st.bound == "memory:DRAM"
    big = model(hw([Tier("SRAM", 64e6, 10e12), Tier("DRAM", 1e12, 100e9)])).step([(0, 1)], 1)
    assert big.bound == "memory:SRAM" and "memory:DRAM" not in big.parts
    assert big.parts["memory:SRAM"] == pytest.approx((LAYER + HEAD + NORMS + ROW + 17 * KV) / 10e12)
    with pytest.raises(TokenhaulError, match="do not fit"):
        place(hw([Tier("SRAM", 20e6, 10e12)]), resident, 0)
    assert place(Hardware("t", "t", (Tier("SRAM", 20e6, 10e12),), {"bf16": 1.0}, chips=0), resident, 0).chips == 2


def test_pim_attention_never_crosses_the_bus():
    """Decode attention in memory at 4 TB/s internal: its 4 × 1024 K/V reads (64 blocks of 16) plus the
    write stay off the bus, which carries exactly the weights; a prefill's attention uses the bus."""
    pim = PIM(("attention",), internal_bandwidth=4e12, flops=HUGE)
    m = model(hw([Tier("HBM", 80e9, 1e12)], pim=pim), kv_tokens=4096)
    st = m.step([(1023, 1)] * 4, 4)
    kv = 4 * 1024 * KV + 4 * KV
    assert st.bus_bytes == {"HBM": LAYER + NORMS + 4 * ROW + HEAD}
    assert st.pim_bytes == kv and st.parts["pim"] == pytest.approx(kv / 4e12)
    pre = m.step([(0, 64)], 1)
    assert pre.pim_bytes == 0 and pre.bus_bytes["HBM"] > LAYER + HEAD


def test_prediction_phases_follow_the_schedule():
    w = Workload("t", CFG, batch=3, context=300, new_tokens=4, max_batched_tokens=512)
    p = predict(w, hw([Tier("DRAM", 1e12, 100e9)]))
    assert p.prefill.tokens + p.decode.tokens == 3 * 300 + 3 * 3  # the last token of each is never computed
    assert p.prefill.sampled + p.decode.sampled == 3 * 4
    assert p.decode.steps == 3 and p.ttft_s <= p.prefill.seconds + p.decode.seconds
    assert p.tpot_s == pytest.approx(p.decode.seconds / 3)
    dram = hw([Tier("DRAM", 1e12, 100e9)])
    spec = predict(Workload("t", CFG, decoding=Decoding("speculative", 4, 0.8)), dram)  # 3.36 tokens per verify
    assert spec.tpot_s < predict(Workload("t", CFG), dram).tpot_s / 3


def test_weight_only_formats_multiply_in_bf16_unless_measured():
    gpu = Hardware("g", "g", (Tier("HBM", 80e9, 3e12),), {"bf16": 1e15, "int8": 2e15})
    assert gpu.linear_flops("int8") == gpu.linear_flops("int4") == 1e15  # W8A16 / W4A16: bf16 math
    cpu = Hardware("c", "c", (Tier("DRAM", 8e9, 2e10),), {"bf16": 9e10}, weight_only_flops={"int4": 3e10})
    assert cpu.linear_flops("int4") == 3e10 and cpu.linear_flops("int8") == 9e10


def test_measured_linear_times_replace_the_roofline():
    """this-machine times each linear shape at a number of rows (whatif/kernels.py): a decode of 4 rows
    costs the 4 layer linears (qkv 3072x1024, o, gate+up 8192x1024, down) and the lm_head at 1 row."""
    calls = []

    def timer(fmt, out, in_, rows, working_set):
        assert working_set > 0  # the model's weights: the span the kernels are timed over
        calls.append((fmt, out, in_, rows))
        return 1e-3 * rows

    st = model(hw([Tier("DRAM", 1e12, HUGE)], linear_times=timer)).step([(0, 1), (16, 1), (32, 1), (48, 1)], 1)
    assert {(o, i) for _, o, i, _ in calls} == {(3072, 1024), (1024, 1024), (8192, 1024), (1024, 4096), (1000, 1024)}
    assert st.parts["compute"] == pytest.approx(4 * 4e-3)  # 4x their one-row time: compute-bound
    assert st.parts["memory:DRAM"] == pytest.approx(1e-3)  # the lm_head's one row: as a GEMV, memory-bound


def test_kernel_curves_interpolate_between_measured_rows():
    from tokenhaul.whatif.kernels import interpolate

    curve = [(1, 1.0), (8, 2.0), (64, 9.0)]
    assert interpolate(curve, 1) == 1.0 and interpolate(curve, 4) == pytest.approx(1 + 3 / 7)
    assert interpolate(curve, 128) == pytest.approx(9.0 + 7.0 * 64 / 56)  # extended from the last two


def test_decode_time_grows_with_context_and_no_part_is_negative():
    """A lone decode on a bf16 cache is read in place (the C++ kernel), not a view of gathered blocks: the
    gather copy costs nothing then, so decode time grows with context and no part goes below zero."""
    dram = hw([Tier("DRAM", 1e12, 100e9)], paged_kernel="gather", gather_bandwidth=10e9)
    tpot = []
    for context in (512, 4096, 8000):
        p = predict(Workload("t", CFG, context=context, new_tokens=8, quantization="int4"), dram)
        for phase in ("prefill", "decode"):
            assert all(s >= 0 for s in p.as_dict()["seconds_by_part"][phase].values()), (context, phase)
        tpot.append(p.tpot_s)
    assert 0 < tpot[0] < tpot[1] < tpot[2]


@pytest.mark.parametrize("kv, in_place", [("bf16", True), ("fp32", False)])
def test_schedule_views_what_the_runner_views(kv: str, in_place: bool) -> None:
    """As engine/runner.py: only a call of one sequence is read as a view, and never a decode read in place;
    two prompts sharing a call are gathered. Views never exceed the slots a step gathers."""
    from tokenhaul.kv import decode_attention
    from tokenhaul.ledger.costs import step_costs
    from tokenhaul.whatif.workload import schedule

    if in_place and not decode_attention.available():
        pytest.skip("no C++ compiler: bf16 decodes are gathered, not read in place")
    w = Workload("t", CFG, batch=2, context=40, new_tokens=3, kv_dtype=kv)
    assert w.costs().decodes_in_place == in_place
    steps = list(schedule(w))
    assert steps[0] == ([(0, 40), (0, 40)], 2, 0)  # one call of two prompts: gathered
    assert all(view == 0 for chunks, _, view in steps if len(chunks) > 1)
    for chunks, sampled, _ in steps:
        assert step_costs(w.costs(), chunks, sampled, block_size=16).kv_gather_bytes >= 0
    one = list(schedule(Workload("t", CFG, context=40, new_tokens=3, kv_dtype=kv)))
    assert one[0][2] == 48  # a lone prompt: its 3 blocks are a view
    assert [view for _, _, view in one[1:]] == [0 if in_place else 48] * 2
