"""Replay a recorded run (`tokenhaul trace` → steps.jsonl) through the what-if model: each recorded
step's shapes timed on a profile, beside the engine time the ledger measured for it."""

from __future__ import annotations

import json
from pathlib import Path

from tokenhaul.errors import TokenhaulError
from tokenhaul.whatif.hardware import Hardware
from tokenhaul.whatif.model import StepModel, place
from tokenhaul.whatif.workload import Workload


def _number(x: object) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def _step(r: object) -> tuple[list[tuple[int, int]], int, int, float]:
    """A step record's (chunks as (start, tokens), sampled count, view slots, measured seconds); ValueError naming
    what is wrong when it is not one `tokenhaul trace` writes."""
    if not isinstance(r, dict):
        raise ValueError("not a JSON object")
    missing = [k for k in ("chunks", "sampled", "stage_seconds") if k not in r]
    if missing:
        raise ValueError(f"no {', '.join(missing)}")
    chunks, sampled, stages, view = r["chunks"], r["sampled"], r["stage_seconds"], r.get("kv_view_slots", 0)
    if not isinstance(chunks, list) or not chunks or not all(
            isinstance(c, list) and len(c) == 3 and isinstance(c[1], int) and isinstance(c[2], int)
            and c[1] >= 0 and c[2] >= 1 for c in chunks):
        raise ValueError("chunks must be a non-empty list of [request, start, tokens]")
    if not isinstance(sampled, list):
        raise ValueError("sampled must be a list")
    if not isinstance(stages, dict) or not stages or not all(_number(v) and v >= 0 for v in stages.values()):
        raise ValueError("stage_seconds must map stages to seconds")
    if not isinstance(view, int) or view < 0:
        raise ValueError("kv_view_slots must be a non-negative integer")
    return [(start, n) for _, start, n in chunks], len(sampled), view, float(sum(stages.values()))


def read_steps(path: Path) -> list[tuple[list[tuple[int, int]], int, int, float]]:
    """The step records of a steps.jsonl, checked; TokenhaulError naming the file (and line) otherwise."""
    try:
        lines = path.read_text().splitlines()
    except (OSError, ValueError) as e:
        raise TokenhaulError(f"cannot read step records from {path}: {e}") from None
    steps = []
    for i, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            steps.append(_step(json.loads(line)))
        except ValueError as e:  # json.JSONDecodeError too
            raise TokenhaulError(f"{path} line {i} is not a step record of `tokenhaul trace`: {e}") from None
    if not steps:
        raise TokenhaulError(f"{path} holds no step records")
    return steps


def replay(path: Path, w: Workload, hw: Hardware) -> str:
    """Per phase: steps, measured engine seconds, predicted seconds, ratio."""
    steps = read_steps(path)
    model = StepModel(hw, w.costs(), w.quantization, place(hw, w.resident_weight_bytes, w.resident_kv_bytes),
                      w.block_size)
    totals = {"prefill": [0, 0.0, 0.0], "decode": [0, 0.0, 0.0]}
    for chunks, sampled, view, measured in steps:
        st = model.step(chunks, sampled, view)
        t = totals["prefill" if any(n > 1 for _, n in chunks) else "decode"]
        t[0] += 1
        t[1] += measured
        t[2] += st.seconds
    lines = [f"replay of {len(steps)} steps on {hw.name} ({w.name}, {w.quantization} weights, {w.kv_dtype} KV, "
             f"sparsity {w.sparsity:g}):"]
    for phase, (n, meas, pred) in totals.items():
        if n:
            ratio = f"{pred / meas:.2f}" if meas else "n/a: nothing measured"
            lines.append(f"  {phase}: {n} steps, measured {meas:.4g} s, predicted {pred:.4g} s "
                         f"(predicted/measured {ratio})")
    return "\n".join(lines)
