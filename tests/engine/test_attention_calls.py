"""Attention calls split by KV length: the split minimises padded slots + a cost per call, the runner
makes exactly the calls the step-time model counts, and greedy output does not depend on the split."""

from __future__ import annotations

import torch
from tiny_models import tiny_model

from tokenhaul.config import EngineConfig
from tokenhaul.engine.attention_calls import CALL_SLOTS, attention_calls, split_by_length
from tokenhaul.engine.core import EngineCore
from tokenhaul.engine.request import Request
from tokenhaul.engine.scheduler import SchedulerOutput, chunk
from tokenhaul.engine.step_time import StepShape
from tokenhaul.layers.attention import AttentionMetadata, AttnGroup, paged_attention
from tokenhaul.sampling_params import SamplingParams


def brute_force_cost(lengths: list[int], bs: int, call: int) -> int:
    """The cheapest split into contiguous runs of the sorted order, by trying every cut set."""
    spans = sorted(-(-n // bs) * bs for n in lengths)
    best = None
    for mask in range(2 ** (len(spans) - 1)):
        cost, start = 0, 0
        for j in range(1, len(spans) + 1):
            if j == len(spans) or mask >> (j - 1) & 1:
                cost += (j - start) * spans[j - 1] + call
                start = j
        best = cost if best is None else min(best, cost)
    return best


def test_split_is_the_cheapest_and_keeps_near_lengths_together():
    lengths = [60, 1500, 70, 800, 75, 1490, 820, 64]
    runs = split_by_length(lengths, 16)
    assert sorted(i for r in runs for i in r) == list(range(len(lengths)))
    cost = sum(len(r) * -(-max(lengths[i] for i in r) // 16) * 16 + CALL_SLOTS for r in runs)
    assert cost == brute_force_cost(lengths, 16, CALL_SLOTS)
    assert [sorted(lengths[i] for i in r) for r in runs] == [[60, 64, 70, 75], [800, 820], [1490, 1500]]
    assert split_by_length([100] * 5, 16) == [[0, 1, 2, 3, 4]]  # equal contexts: one call
    assert split_by_length([20, 40], 16, call_slots=0) == [[0], [1]]


def test_calls_split_by_query_length_first():
    chunks = [(1, 30), (5, 40), (1, 1500), (5, 45), (1, 31)]
    assert attention_calls(chunks, 16) == [[0, 4], [2], [1, 3]]


def test_runner_makes_the_calls_the_step_model_counts():
    core = EngineCore(EngineConfig(model="tiny", dtype="fp32", num_kv_blocks=512, block_size=4), tiny_model())
    lengths = [3, 900, 5, 880, 7, 12]
    blocks = core.pool.allocate(230)
    sched = SchedulerOutput()
    shape = StepShape(4)
    for i, n in enumerate(lengths):
        req = Request(f"r{i}", [1 + (t % 50) for t in range(n)], SamplingParams(max_tokens=4))
        req.block_ids = blocks[:-(-n // 4)]
        req.num_computed_tokens = n - 1
        sched.chunks.append(chunk(req, 1))
        shape.add(n - 1, 1, 1)
    sched.chunks.append(chunk(Request("p", list(range(1, 41)), SamplingParams(max_tokens=4)), 40))
    shape.add(0, 40, 1)
    sched.chunks[-1].request.block_ids = blocks[:10]
    inp = core.runner.prepare(sched)
    ran = [(q, len(ends), -(-max(ends) // 4) * 4) for q, ends in inp.attn_groups]
    assert ran == shape.calls() and len(ran) == 3
    assert [g.batch for g in inp.meta.groups] == [b for _, b, _ in ran]


def test_greedy_tokens_do_not_depend_on_what_else_runs():
    """Short and long contexts decoding together (split into several calls) give what each gives alone."""
    prompts = [[(7 * i + 3 * t) % 96 + 1 for t in range(n)] for i, n in enumerate([6, 300, 9, 290, 40])]
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)

    def run(batch: list[list[int]]) -> list[list[int]]:
        core = EngineCore(EngineConfig(model="tiny", dtype="fp32", num_kv_blocks=512, block_size=4), tiny_model())
        for i, p in enumerate(batch):
            core.add_request(f"r{i}", p, params)
        out: dict[str, list[int]] = {f"r{i}": [] for i in range(len(batch))}
        while core.has_unfinished():
            for d in core.step():
                out[d.request_id] += d.new_token_ids
        return [out[f"r{i}"] for i in range(len(batch))]

    together = run(prompts)
    assert together == [run([p])[0] for p in prompts]


def test_a_decode_row_has_the_same_bits_alone_padded_or_batched():
    """bf16 cache, fp32 queries (as the models hand them): a decode's attention output does not depend
    on the other sequences of its call nor on how far its keys are padded."""
    g = torch.Generator().manual_seed(0)
    H, HKV, D, BS = 9, 3, 64, 16
    lengths = [50, 300, 700, 1500, 90]
    k_cache = torch.randn(512, BS, HKV, D, generator=g).bfloat16()
    v_cache = torch.randn(512, BS, HKV, D, generator=g).bfloat16()
    q = torch.randn(len(lengths), H, D, generator=g)
    tables = [list(range(1 + 100 * i, 1 + 100 * i + -(-n // BS))) for i, n in enumerate(lengths)]

    def attend(rows: list[int]) -> torch.Tensor:
        nb = max(len(tables[i]) for i in rows)
        table = torch.tensor([(tables[i] + [0] * nb)[:nb] for i in rows])
        pos = torch.tensor([lengths[i] - 1 for i in rows])
        mask = (torch.arange(nb * BS)[None, :] <= pos[:, None])[:, None, None, :]
        slots = torch.tensor([tables[i][(lengths[i] - 1) // BS] * BS + (lengths[i] - 1) % BS for i in rows])
        meta = AttentionMetadata(pos, slots, [AttnGroup(len(rows), 1, None, table, mask, mask)], len(rows))
        k_new = k_cache.view(-1, HKV, D)[slots].clone()  # rewrite what is there: the cache stays the same
        v_new = v_cache.view(-1, HKV, D)[slots].clone()
        return paged_attention(q[rows], k_new, v_new, k_cache, v_cache, meta, D ** -0.5, sliding=False)

    together = attend(list(range(len(lengths))))
    for i in range(len(lengths)):
        assert torch.equal(attend([i])[0], together[i])
        assert torch.equal(attend([i, 3])[0], together[i])  # padded to the 1500-token context
