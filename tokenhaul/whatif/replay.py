"""Replay a recorded run (`tokenhaul trace` → steps.jsonl) through the what-if model: each recorded
step's shapes timed on a profile, beside the engine time the ledger measured for it."""

from __future__ import annotations

import json
from pathlib import Path

from tokenhaul.errors import TokenhaulError
from tokenhaul.whatif.hardware import Hardware
from tokenhaul.whatif.model import StepModel, place
from tokenhaul.whatif.workload import Workload


def replay(path: Path, w: Workload, hw: Hardware) -> str:
    """Per phase: steps, measured engine seconds, predicted seconds, ratio."""
    try:
        records = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    except (OSError, ValueError) as e:
        raise TokenhaulError(f"cannot read step records from {path}: {e}") from None
    model = StepModel(hw, w.costs(), w.quantization, place(hw, w.resident_weight_bytes, w.resident_kv_bytes),
                      w.block_size)
    totals = {"prefill": [0, 0.0, 0.0], "decode": [0, 0.0, 0.0]}
    for r in records:
        chunks = [(start, n) for _, start, n in r["chunks"]]
        st = model.step(chunks, len(r["sampled"]), r.get("kv_view_slots", 0))
        t = totals["prefill" if any(n > 1 for _, n in chunks) else "decode"]
        t[0] += 1
        t[1] += sum(r["stage_seconds"].values())
        t[2] += st.seconds
    lines = [f"replay of {len(records)} steps on {hw.name} ({w.name}, {w.quantization} weights, {w.kv_dtype} KV, "
             f"sparsity {w.sparsity:g}):"]
    for phase, (n, meas, pred) in totals.items():
        if n:
            lines.append(f"  {phase}: {n} steps, measured {meas:.4g} s, predicted {pred:.4g} s "
                         f"(predicted/measured {pred / meas:.2f})")
    return "\n".join(lines)
