"""--deterministic: a token's attention output is bit-identical however its chunk was split and
whatever else shares the call (the default kernels tile queries and split a lone query's keys)."""

from __future__ import annotations

import pytest
import torch
from tiny_models import tiny_model

from tokenhaul.config import EngineConfig
from tokenhaul.engine.core import EngineCore
from tokenhaul.layers.attention import _per_query_sdpa
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
