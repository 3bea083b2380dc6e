"""Calibrating the step-time model on this machine: time real batches through the core's own runner
and decoder, fit `StepTimeModel`, cache the fit per machine | model | engine settings.

The batches are synthetic requests over blocks borrowed from the (still empty) KV pool and given
back at the end; the grid spans decode batches of several sizes and key spans, prefill chunks of
several lengths and offsets, and mixes of both, within the engine's own limits. Shapes are timed
round-robin and the fastest of `repeats` is kept (it also drops a shape's first-call costs): load
from elsewhere only ever adds time, and the online scale (step_time.py) follows it."""

from __future__ import annotations

import dataclasses
import json
import time
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from tokenhaul.atomic import atomic_path
from tokenhaul.engine.request import Request
from tokenhaul.engine.scheduler import SchedulerOutput, chunk
from tokenhaul.engine.step_time import StepShape, StepTimeModel, default_knots
from tokenhaul.host import cpu_model
from tokenhaul.models.catalog import cache_root
from tokenhaul.sampling_params import SamplingParams

if TYPE_CHECKING:
    from tokenhaul.engine.core import EngineCore

CACHE_FILE = "step_time.json"
Chunk = tuple[int, int, bool]  # (start, tokens, samples)
_GREEDY = SamplingParams(max_tokens=1, temperature=0.0)
_memo: dict[str, StepTimeModel] = {}


def grid_span(max_len: int) -> int:
    """The longest key span the grid times (longer contexts extrapolate linearly)."""
    return max(8, min(max_len, 1024))


def calibration_grid(max_tokens: int, max_seqs: int, max_len: int) -> list[list[Chunk]]:
    """Batches to time: decode batches at every knot of the token count (short keys), at a few long
    key spans and with mixed key spans (several attention calls), prefill chunks at every knot (at the
    start and half-way into the context), and decodes mixed with a chunk."""
    span = grid_span(max_len)
    knots = default_knots(max_tokens)
    seqs = min(max_seqs, max_tokens)
    short, mid, long = max(2, span // 32), max(2, span // 4), max(2, span * 3 // 4)
    grid: list[list[Chunk]] = [[(short - 1, 1, True)] * d for d in knots if d <= seqs]
    grid += [[(c - 1, 1, True)] * d for d in sorted({max(1, seqs // 8), max(1, seqs // 4), seqs}) for c in (mid, long)]
    d = max(2, seqs // 2)
    grid += [[(short - 1 + (span - short) * i // (d - 1), 1, True) for i in range(d)]]  # spread: several calls
    grid += [[(0, n, False)] for n in knots if n >= 2]
    grid += [[(span // 2, n, True)] for n in sorted({max(2, max_tokens // 8), max_tokens}) if span // 2 + n <= span]
    d = max(1, seqs // 4)
    grid += [[(mid - 1, 1, True)] * d + [(0, n, True)] for n in sorted({max(2, max_tokens // 8), max_tokens // 2})
             if d + n <= max_tokens]
    return grid


def shape_of(chunks: list[Chunk], block_size: int) -> StepShape:
    s = StepShape(block_size)
    for start, n, samples in chunks:
        s.add(start, n, int(samples))
    return s


def time_batch(core: EngineCore, chunks: list[Chunk], block_ids: list[int]) -> float:
    """Seconds for prepare → forward → verify of one synthetic batch (the span the core measures)."""
    bs = core.pool.block_size
    vocab = core.model.config.vocab_size
    sched = SchedulerOutput()
    for i, (start, n, samples) in enumerate(chunks):
        length = start + n + (0 if samples else 1)
        req = Request(f"calibrate-{i}", [(7 * t + i) % vocab for t in range(length)], _GREEDY)
        req.block_ids = block_ids[:-(-length // bs)]
        req.num_computed_tokens = start
        sched.chunks.append(chunk(req, n))
    t = time.perf_counter()
    inp = core.runner.prepare(sched)
    logits = core.runner.forward(inp)
    core.decoder.verify(logits, inp.sample_chunks)
    if logits.device.type == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter() - t


def measure(core: EngineCore, grid: list[list[Chunk]], repeats: int = 2) -> list[float]:
    """Fastest seconds per batch of the grid over `repeats` round-robin passes."""
    bs = core.pool.block_size
    longest = max(start + n + 1 for chunks in grid for start, n, _ in chunks)
    need = -(-longest // bs)
    if need > core.pool.num_free:
        raise ValueError(f"calibration needs {need} free KV blocks, the pool has {core.pool.num_free}")
    blocks = core.pool.allocate(need)
    try:
        times: list[list[float]] = [[] for _ in grid]
        for _ in range(repeats):
            for i, chunks in enumerate(grid):
                times[i].append(time_batch(core, chunks, blocks))
    finally:
        core.pool.free(blocks)
    return [min(t) for t in times]


def calibrate(core: EngineCore, repeats: int = 2) -> StepTimeModel:
    """Measure the grid for this core's limits and fit a model (takes seconds on a real model)."""
    sc = core.scheduler.config
    kv_len = (core.pool.num_free - 1) * core.pool.block_size
    grid = calibration_grid(sc.max_num_batched_tokens, sc.max_num_seqs, min(sc.max_model_len, kv_len))
    seconds = measure(core, grid, repeats)
    shapes = [shape_of(g, core.pool.block_size) for g in grid]
    return StepTimeModel.fit(shapes, seconds, default_knots(sc.max_num_batched_tokens))


def calibration_key(core: EngineCore) -> str:
    """Machine | torch | threads | model architecture | grid span | engine settings that change step time."""
    skip = {"kv_memory_gib", "num_kv_blocks", "enable_prefix_caching", "itl_target_ms", "max_model_len"}
    sc = core.scheduler.config
    span = grid_span(min(sc.max_model_len, (core.pool.num_free - 1) * core.pool.block_size))
    settings = {k: v for k, v in dataclasses.asdict(core.config).items() if k not in skip}
    c = core.model.config
    model = (f"{c.arch} L{c.num_layers} h{c.hidden_size} ffn{c.ffn_size} heads{c.num_heads}/{c.num_kv_heads} "
             f"v{c.vocab_size}")
    return (f"{cpu_model()} | torch {torch.__version__} | threads={torch.get_num_threads()} | {model} | span {span} | "
            + json.dumps(settings, sort_keys=True))


def load_or_calibrate(core: EngineCore, root: Path | None = None) -> StepTimeModel:
    """The cached fit for this core's key, else calibrate now and store it (mutates the cache file)."""
    key = calibration_key(core)
    path = (root or cache_root()) / CACHE_FILE
    memo = f"{path}|{key}"
    if memo not in _memo:
        table = _load(path)
        if key in table:
            try:
                _memo[memo] = StepTimeModel.from_dict(table[key])
            except ValueError:
                pass
        if memo not in _memo:
            t = time.perf_counter()
            model = calibrate(core)
            table[key] = model.to_dict() | {"measured_at": time.time(), "measure_seconds": time.perf_counter() - t}
            path.parent.mkdir(parents=True, exist_ok=True)
            with atomic_path(path) as tmp:
                tmp.write_text(json.dumps(table, indent=1, sort_keys=True))
            _memo[memo] = model
    return StepTimeModel.from_dict(_memo[memo].to_dict())  # a fresh scale per core


def _load(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return {}


