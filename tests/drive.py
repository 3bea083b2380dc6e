"""Drive an EngineCore to completion in tests: prompts in, generated token ids out (prompt order)."""

from __future__ import annotations

from tokenhaul.engine.core import EngineCore
from tokenhaul.sampling_params import SamplingParams


def run_requests(core: EngineCore, prompts: list[list[int]], params: SamplingParams) -> list[list[int]]:
    for i, p in enumerate(prompts):
        core.add_request(f"r{i}", p, params)
    out = {f"r{i}": [] for i in range(len(prompts))}
    while core.has_unfinished():
        for d in core.step():
            out[d.request_id] += d.new_token_ids
    return [out[f"r{i}"] for i in range(len(prompts))]
