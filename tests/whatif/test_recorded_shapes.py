"""The runner records the attention calls it ran in each StepRecord, and the ledger's costs come from
them rather than from a second copy of the runner's grouping rules."""

from __future__ import annotations

import dataclasses

import torch
from tiny_models import tiny_model

from tokenhaul.config import EngineConfig
from tokenhaul.engine.core import EngineCore
from tokenhaul.ledger.costs import ModelCosts
from tokenhaul.ledger.ledger import Ledger
from tokenhaul.sampling_params import SamplingParams


def test_step_records_carry_the_groups_the_runner_ran():
    model = tiny_model()
    core = EngineCore(EngineConfig(model="tiny", dtype="fp32", num_kv_blocks=64, block_size=4), model)
    ledger = core.observer = Ledger(ModelCosts.from_model(model, 4))
    runs = []
    prepare = core.runner.prepare
    core.runner.prepare = lambda sched: runs.append(prepare(sched)) or runs[-1]
    params = SamplingParams(max_tokens=3, temperature=0, ignore_eos=True)
    for i, n in enumerate((6, 6, 9)):
        core.add_request(f"r{i}", [(5 * i + j) % 90 + 1 for j in range(n)], params)
    with torch.inference_mode():
        while core.has_unfinished():
            core.step()
    first, second = ledger.steps[0].record, ledger.steps[1].record
    assert first.attn_groups == [(6, [6, 6]), (9, [9])]  # the two 6-token prompts share one padded call
    assert second.attn_groups == [(1, [7, 7, 10])]
    for entry, inp in zip(ledger.steps, runs):
        assert entry.record.attn_groups == inp.attn_groups
        assert [g.q_len for g in inp.meta.groups] == [q for q, _ in inp.attn_groups]
        assert [g.batch for g in inp.meta.groups] == [len(ends) for _, ends in inp.attn_groups]
    # the ledger costs what was recorded: the same decodes as three separate calls pad to less
    kv_tok = ledger.costs.kv_bytes_per_token
    assert ledger.steps[1].costs.kv_read_bytes == 3 * 12 * kv_tok  # one call, padded to 3 blocks of 4
    alone = Ledger(ledger.costs)
    alone.on_step(dataclasses.replace(second, attn_groups=[(1, [7]), (1, [7]), (1, [10])]))
    assert alone.steps[0].costs.kv_read_bytes == (8 + 8 + 12) * kv_tok
