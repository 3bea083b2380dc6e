"""What one forward costs the draft/target pair, by weight format and rows: the figures behind the
draft's defaults (packed int4 drafting, dense catch-up above PREFILL_ROWS, decoding/speculative.py).

Per model and format: median ms of a forward of M rows at position ~300 (decode M=1, a k+1-row
verify) and of a 200-token prefill chunk. bf16 activations, 2 threads.

    flock -x /tmp/tokenhaul-bench.lock .venv/bin/python bench/draft_cost.py
"""

from __future__ import annotations

import argparse
import gc
import statistics
import time

import torch

from tokenhaul.engine.request import Request
from tokenhaul.engine.runner import ModelRunner
from tokenhaul.engine.scheduler import ScheduledChunk, SchedulerOutput
from tokenhaul.kv.cache import KVCache
from tokenhaul.models.catalog import resolve
from tokenhaul.models.registry import load_model
from tokenhaul.sampling_params import SamplingParams

CTX = 300
PREFILL = 200


def timed(runner: ModelRunner, req: Request, start: int, rows: int, reps: int) -> float:
    ts = []
    for _ in range(reps):
        inp = runner.prepare(SchedulerOutput([ScheduledChunk(req, start, rows, 0, 1)]))
        t = time.perf_counter()
        runner.forward(inp)
        ts.append(time.perf_counter() - t)
    return statistics.median(ts) * 1e3


def measure(alias: str, quant: str, rows: list[int]) -> None:
    files = resolve(alias)
    model = load_model(files.gguf_path, torch.bfloat16, "cpu", 2048, quant, files.cache_dir)
    c = model.config
    kv = KVCache(c.num_layers, 64, 16, c.num_kv_heads, c.head_dim, torch.bfloat16, "cpu")
    runner = ModelRunner(model, kv, "cpu")
    req = Request("x", list(range(100, 100 + CTX + 16)), SamplingParams())
    req.block_ids = list(range(40))
    prefill = timed(runner, req, 0, PREFILL, 2)
    runner.forward(runner.prepare(SchedulerOutput([ScheduledChunk(req, 0, CTX, 0, 1)])))
    cells = "".join(f"{timed(runner, req, CTX, m, 10):>9.1f}" for m in rows)
    print(f"{alias:<20}{quant:<7}{cells}{prefill:>12.0f}", flush=True)
    del model, kv, runner
    gc.collect()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    rows = [1, 2, 5, 9]
    print(f"{'model':<20}{'format':<7}" + "".join(f"{f'M={m} ms':>9}" for m in rows) + f"{f'{PREFILL} tok ms':>12}")
    measure("qwen2.5-coder-1.5b", "none", rows)
    measure("qwen2.5-coder-1.5b", "int4", rows)
    for quant in ["none", "int8", "int4"]:
        measure("qwen2.5-coder-0.5b", quant, rows)


if __name__ == "__main__":
    main()
