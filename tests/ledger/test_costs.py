"""costs.py against an independent count: the aten ops a step runs (weights touched, K/V gathered and
written, FLOPs) and the tensors the runner hands to the model (metadata), on tiny random models."""

from __future__ import annotations

import pytest
import torch
from probe import TrafficCounter, model_input_bytes
from tiny_models import tiny_model

from tokenhaul.ledger.costs import ModelCosts, StepCosts, step_costs
from tokenhaul.sampling_params import SamplingParams

GREEDY = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)

SCENARIOS = {
    "single": dict(lengths=[9]),
    "unequal-batch": dict(lengths=[5, 9, 14]),  # padded decode group
    "chunked-mixed": dict(lengths=[20, 11, 3], max_num_batched_tokens=8),  # decodes + prefill chunks together
    "gemma-window": dict(arch="gemma3", lengths=[9, 4]),  # sliding-window masks past position 6
    "bf16-kv": dict(dtype="bf16", lengths=[7, 10]),  # decodes read their blocks in place (the C++ kernel)
    "bf16-kv-deterministic": dict(dtype="bf16", lengths=[7, 10], deterministic=True),  # gather converts to fp32
    "gemma-window-bf16": dict(arch="gemma3", dtype="bf16", lengths=[9, 4]),  # in place: local layers' window only
    # prompt logprobs: the lm_head over every prompt position too, in chunks, beside a request without them
    "prompt-logprobs": dict(lengths=[20, 11], max_num_batched_tokens=8, params=[
        SamplingParams(max_tokens=8, temperature=0, ignore_eos=True, prompt_logprobs=2), GREEDY]),
}


def drive(core, ledger, lengths, params=None):
    """Run every request to the end, counting each step's traffic independently."""
    for i, n in enumerate(lengths):
        core.add_request(f"r{i}", [(7 * i + 3 * j) % 90 + 1 for j in range(n)], params[i] if params else GREEDY)
    inputs = []
    prepare = core.runner.prepare
    core.runner.prepare = lambda sched: inputs.append(prepare(sched)) or inputs[-1]
    rows = []
    while core.has_unfinished():
        with TrafficCounter(core.model, core.kv) as tc:
            core.step()
        rows.append((ledger.steps[-1].costs, tc, model_input_bytes(inputs[-1])))
    return rows


@pytest.mark.parametrize("name", SCENARIOS)
def test_bytes_and_flops_equal_independent_count(ledger_core, name):
    kw = dict(SCENARIOS[name])
    lengths, params = kw.pop("lengths"), kw.pop("params", None)
    core, ledger = ledger_core(**kw)
    rows = drive(core, ledger, lengths, params)
    assert len(rows) >= 8
    for costs, tc, meta in rows:
        assert costs.weight_bytes == pytest.approx(tc.weight_bytes, rel=0.02)
        assert costs.kv_read_bytes == pytest.approx(tc.kv_read, rel=0.02)
        assert costs.kv_write_bytes == pytest.approx(tc.kv_write, rel=0.02)
        assert costs.flops == pytest.approx(tc.flops, rel=0.02)
        assert costs.metadata_bytes == meta
        assert costs.h2d_bytes == costs.d2h_bytes == 0  # one memory on a CPU
    assert ledger.prompt_tokens == sum(lengths)  # mixed steps: decodes are not counted as prompt
    if name == "unequal-batch":
        assert any(c.kv_pad_bytes > 0 for c, _, _ in rows)


def test_copy_on_write_bytes(ledger_core):
    core, ledger = ledger_core()
    with TrafficCounter(core.model, core.kv) as tc:
        core.kv.copy_block(1, 2)
    c = step_costs(ledger.costs, [(0, 1)], 1, kv_copy_tokens=core.kv.block_size, block_size=core.kv.block_size)
    assert c.kv_copy_bytes == tc.kv_copy > 0


def test_weights_from_model_tensors(ledger_core):
    core, ledger = ledger_core()
    m = core.model
    linears = [v for layer in m.layers for v in vars(layer).values() if hasattr(v, "weight_bytes")]
    mc = ModelCosts.from_model(m, 4)
    assert mc.layer_weight_bytes == sum(lin.weight.nbytes for lin in linears)
    assert mc.lm_head_bytes == m.lm_head.weight.nbytes
    assert mc.kv_bytes_per_token * core.kv.num_blocks * core.kv.block_size == core.kv.nbytes


def test_device_counts_host_transfers(ledger_core):
    """On a GPU the metadata crosses to the device (aliased masks twice) and token ids come back."""
    import dataclasses

    _, ledger = ledger_core()
    mc = dataclasses.replace(ledger.costs, device="cuda")
    cpu = step_costs(ledger.costs, [(0, 12), (5, 1)], 2)
    gpu = step_costs(mc, [(0, 12), (5, 1)], 2)
    assert gpu.h2d_bytes >= gpu.metadata_bytes == cpu.metadata_bytes > 0
    assert gpu.d2h_bytes == 2 * 8
    assert step_costs(mc, [], 0) == StepCosts()


def test_accumulate():
    a, b = StepCosts(weight_bytes=3, flops=5), StepCosts(weight_bytes=4, kv_read_bytes=2)
    a.add(b)
    assert a.as_dict()["weight_bytes"] == 7 and a.kv_read_bytes == 2 and a.flops == 5
    assert a.dram_bytes == 9 and a.total_bytes == 9


def test_a_step_costs_its_attention_groups_each_as_alone():
    """Gemma3 (sliding-window layers) over bf16 K/V: a step of a prefill chunk and decodes past the window costs
    the sum of its groups costed alone, whichever group comes first."""
    mc = ModelCosts.from_model(tiny_model("gemma3", torch.bfloat16), 2)
    groups = [(5, [20]), (1, [30, 12, 9])]
    whole = [step_costs(mc, [], 0, block_size=4, attn_groups=gs) for gs in (groups, groups[::-1])]
    parts = [step_costs(mc, [], 0, block_size=4, attn_groups=[g]) for g in groups]
    for w in whole:
        assert w.kv_read_bytes == sum(p.kv_read_bytes for p in parts)
        assert w.kv_gather_bytes == sum(p.kv_gather_bytes for p in parts)


def test_rejected_drafts_are_not_charged_a_neighbours_prompt_logprobs(ledger_core):
    """The bytes charged to rejected drafts are theirs alone: a request beside them asking for prompt logprobs
    (extra lm_head rows in the same steps) leaves them unchanged."""
    def rejected(prompt_logprobs):
        core, ledger = ledger_core(max_num_batched_tokens=24, num_kv_blocks=128)
        rep = [(i * 37) % 96 + 1 for i in range(12)]
        core.add_request("a", rep * 3, SamplingParams(max_tokens=40, temperature=0, ignore_eos=True,
                                                      speculative="prompt_lookup"))
        core.step()
        core.add_request("b", [(i * 11) % 90 + 3 for i in range(300)],
                         SamplingParams(max_tokens=2, temperature=0, prompt_logprobs=prompt_logprobs))
        while core.has_unfinished():
            core.step()
        assert any(s.record.rejected_tokens for s in ledger.steps if s.record.prompt_logprob_rows) == (
            prompt_logprobs is not None)  # some step held both: the case under test
        return ledger.rejected_tokens, ledger.rejected_bytes

    plain, asked = rejected(None), rejected(5)
    assert plain[0] > 0 and asked == plain


def test_views_past_what_was_gathered_cost_no_negative_bytes():
    """A caller's view_slots beyond the slots gathered (a decode read in place is no view) copy nothing."""
    from tokenhaul.kv import decode_attention

    if not decode_attention.available():
        pytest.skip("no C++ compiler: decodes are gathered, not read in place")
    mc = ModelCosts.from_model(tiny_model(dtype=torch.bfloat16), 2)
    assert mc.decodes_in_place
    alone = step_costs(mc, [(5, 1)], 1, block_size=16)
    assert step_costs(mc, [(5, 1)], 1, block_size=16, view_slots=16).kv_gather_bytes == alone.kv_gather_bytes == 0


def test_sparse_linears_multiply_only_their_kept_rows():
    """Activation sparsity (layers/linear_sparse.py): a step of at most max_rows rows multiplies only the kept
    inputs' rows of every sparse projection, as it reads only their bytes; the lm_head over its sampled rows too.
    Past max_rows the layers run dense (zeroed inputs still multiplied); prompt logprob rows are dense."""
    from tokenhaul.layers.linear_sparse import SPARSE_LINEARS, sparsify

    model = tiny_model()
    dense = ModelCosts.from_model(model, 4)
    names = [f"blk.{i}.{n}" for i in range(model.config.num_layers) for n in SPARSE_LINEARS]
    sparsify(model, dict.fromkeys([*names, "lm_head"], 0.1), 0.4)
    mc = ModelCosts.from_model(model, 4)
    assert mc.sparse_rows[0][0] == mc.lm_head_max_rows == 2 and mc.layer_params == dense.layer_params

    def saved(chunks, sampled, **kw):
        return step_costs(dense, chunks, sampled, **kw).flops - step_costs(mc, chunks, sampled, **kw).flops

    layer, head = 2 * dense.layer_params, 2 * dense.lm_head_params  # FLOPs of one row
    assert saved([(10, 1)], 1) == pytest.approx(0.4 * (layer + head), abs=2)
    assert saved([(10, 1), (4, 1)], 2) == pytest.approx(0.4 * 2 * (layer + head), abs=2)
    assert saved([(0, 9)], 1) == pytest.approx(0.4 * head, abs=2)  # the layers' dense pass
    assert saved([(0, 9)], 1, prompt_logit_rows=9) == pytest.approx(0.4 * head, abs=2)
    assert saved([(10, 1), (4, 1), (7, 1)], 3) == 0  # over max_rows: every row multiplied
