"""--deterministic: a token's attention output is bit-identical however its chunk was split and
whatever else shares the call (the default kernels tile queries and split a lone query's keys)."""

from __future__ import annotations

import pytest
import torch
from tiny_models import tiny_model

from tokenhaul.config import EngineConfig
from tokenhaul.engine.core import EngineCore
from tokenhaul.kv import decode_attention
from tokenhaul.layers.attention import AttnGroup, _kernel_rows, _per_query_sdpa
from tokenhaul.layers.quantization import LinearFactory, QuantSpec
from tokenhaul.sampling_params import SamplingParams

H, HKV, D, L = 9, 3, 64, 320  # SmolLM2's heads: big enough that the default kernels split and tile


def _causal(q_pos: torch.Tensor, n: int) -> torch.Tensor:
    return (torch.arange(n)[None, :] <= q_pos[:, None])[None, None]  # [1, 1, Q, n]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("threads", [1, 2])
def test_rows_do_not_depend_on_split_padding_or_batch(dtype, threads):
    g = torch.Generator().manual_seed(0)
    q = torch.randn(1, H, L, D, generator=g).to(dtype)
    k = torch.randn(1, HKV, L, D, generator=g).to(dtype)
    v = torch.randn(1, HKV, L, D, generator=g).to(dtype)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        full = _per_query_sdpa(q, k, v, _causal(torch.arange(L), L), 0.2)
        for s in (1, 17, 40):  # the same rows in a later chunk (a prefix-cache hit, another chunk budget)
            part = _per_query_sdpa(q[:, :, s:], k, v, _causal(torch.arange(s, L), L), 0.2)
            assert torch.equal(part, full[:, :, s:])
        for i in (0, 15, 16, 50, L - 1):  # alone as a decode, keys padded to a 16-slot block
            n = -(-(i + 1) // 16) * 16
            one = _per_query_sdpa(q[:, :, i:i + 1], k[:, :, :n], v[:, :, :n], _causal(torch.tensor([i]), n), 0.2)
            assert torch.equal(one, full[:, :, i:i + 1])
        rows = [3, 33, 70]  # batched with other decodes
        batch = _per_query_sdpa(torch.cat([q[:, :, i:i + 1] for i in rows]), k.expand(3, -1, -1, -1),
                                v.expand(3, -1, -1, -1), torch.cat([_causal(torch.tensor([i]), L) for i in rows]), 0.2)
        for b, i in enumerate(rows):
            assert torch.equal(batch[b:b + 1], full[:, :, i:i + 1])
    finally:
        torch.set_num_threads(before)
    assert torch.get_num_threads() == before


@pytest.mark.parametrize("threads", [1, 2])
def test_kernel_rows_do_not_depend_on_chunk_table_or_batch(threads):
    """--deterministic over a bf16 cache: each query is a row of the decode kernel with its own mask row. A
    prompt's rows give the same bits in one chunk, in a later chunk (a prefix-cache hit), one by one as decodes
    (tables as long as the sequence then, not the chunk) and beside other sequences' decodes."""
    if not decode_attention.available():
        pytest.skip("no C++ compiler")
    g = torch.Generator().manual_seed(1)
    bs, nb = 16, L // 16
    k = torch.randn(64, bs, HKV, D, generator=g).bfloat16()
    v = torch.randn(64, bs, HKV, D, generator=g).bfloat16()
    table = torch.randperm(64, generator=g)[:nb][None]
    q = torch.randn(L, H, D, generator=g).bfloat16()

    def rows(qs: torch.Tensor, positions: torch.Tensor, tables: torch.Tensor) -> torch.Tensor:
        n = tables.shape[1] * bs
        mask = torch.arange(n)[None, :] <= positions[:, None]  # one row per query
        if len(tables) == 1 and len(qs) > 1:  # one sequence's chunk: [1, 1, Q, n]
            return _kernel_rows(qs, AttnGroup(1, len(qs), None, tables, mask[None, None], None), k, v,
                                mask[None, None], 0.125)
        return _kernel_rows(qs, AttnGroup(len(qs), 1, None, tables, mask[:, None, None], None), k, v,
                            mask[:, None, None], 0.125)

    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        full = rows(q, torch.arange(L), table)
        for s in (1, 17, 40):
            assert torch.equal(rows(q[s:], torch.arange(s, L), table), full[s:])
        for i in (0, 15, 16, 50, 200, L - 1):  # a decode: its table holds its own blocks only
            assert torch.equal(rows(q[i:i + 1], torch.tensor([i]), table[:, :i // bs + 1]), full[i:i + 1])
        picks = [3, 70, 300]  # decodes of one step, tables padded to the longest
        batch = rows(q[picks], torch.tensor(picks), table.expand(3, -1))
        assert torch.equal(batch, full[picks])
    finally:
        torch.set_num_threads(before)


def _greedy_with_logprobs(core: EngineCore, prompts: list[list[int]]) -> list[list[tuple[int, float]]]:
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, logprobs=0)
    for i, p in enumerate(prompts):
        core.add_request(f"r{i}", p, params)
    out: dict[str, list[tuple[int, float]]] = {f"r{i}": [] for i in range(len(prompts))}
    while core.has_unfinished():
        for d in core.step():
            out[d.request_id] += [(s.token, s.logprob) for s in d.samples]
    return [out[f"r{i}"] for i in range(len(prompts))]


def test_engine_numbers_do_not_depend_on_chunking_or_batch():
    """bf16 tiny model: prompts prefilled in 5- or 17-token chunks or whole, alone or together, give
    bit-identical tokens and logprobs under deterministic=True (whose linears are built batch-invariant, as
    load_model builds them for it: one kernel at every row count)."""
    make = LinearFactory(QuantSpec("none"), torch.bfloat16, torch.device("cpu"), batch_invariant=True)
    model = tiny_model(dtype=torch.bfloat16, seed=3, make=make)
    prompts = [[(7 * i + j) % 97 for j in range(20 + 9 * i)] for i in range(5)]

    def run(budget: int, together: bool) -> list[list[tuple[int, float]]]:
        cfg = EngineConfig(model="tiny", num_kv_blocks=128, block_size=4, max_num_batched_tokens=budget,
                           deterministic=True)
        if together:
            return _greedy_with_logprobs(EngineCore(cfg, model), prompts)
        return [_greedy_with_logprobs(EngineCore(cfg, model), [p])[0] for p in prompts]

    ref = run(512, together=False)
    for budget, together in ((5, True), (17, True), (17, False), (512, True)):
        assert run(budget, together) == ref, (budget, together)


def test_generated_tokens_read_back_as_a_prompt_give_the_same_numbers():
    """Multi-turn: one turn's output comes back as the next prompt. Under deterministic=True with a bf16 cache
    every query goes through the decode kernel as a row of its own (layers/attention._kernel_rows), so a position
    prefilled gives the same K/V and logits as when it was decoded: continuing from the first 12 generated tokens
    as a prompt gives the same next tokens and logprobs, to the bit, cold or beside other requests."""
    make = LinearFactory(QuantSpec("none"), torch.bfloat16, torch.device("cpu"), batch_invariant=True)
    model = tiny_model(dtype=torch.bfloat16, seed=5, make=make)
    cfg = EngineConfig(model="tiny", num_kv_blocks=128, block_size=4, max_num_batched_tokens=512,
                       deterministic=True, enable_prefix_caching=False)
    core = EngineCore(cfg, model)
    if not core.runner._direct_decodes:
        pytest.skip("no C++ compiler: SDPA one query a row")
    prompt = [(11 * j + 5) % 97 for j in range(41)]
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True, logprobs=0)
    core.add_request("turn1", prompt, params)
    first: list[tuple[int, float]] = []
    while core.has_unfinished():
        first += [(s.token, s.logprob) for d in core.step() for s in d.samples]
    head = [t for t, _ in first[:12]]
    others = [[(3 * i + j) % 89 for j in range(30 + 7 * i)] for i in range(3)]
    cold = _greedy_with_logprobs(EngineCore(cfg, model), [prompt + head])[0]
    together = _greedy_with_logprobs(EngineCore(cfg, model), others + [prompt + head])[-1]
    assert cold == together == first[12:]
