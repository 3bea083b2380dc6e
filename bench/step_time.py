"""Step-time model accuracy on a real model: fit on the calibration grid, predict batches the grid never
saw (mixed decode contexts among them, split into several attention calls), print predicted vs measured.

    .venv/bin/python bench/step_time.py [--model smollm2-135m] [--threads 1] [--repeats 5]

The grid and the held-out batches are timed in the same round-robin passes, fastest of `--repeats` each
(load only ever adds time), so a busy machine weighs on the fit and on the check alike. The scale is taken
from the held-out batches, as the core's online scale follows the steps it times. Target: each held-out
prediction within 20 % under that scale. One thread by default: a neighbour on the other core then leaves
the timings alone, where two threads would be skewed by how much parallel work each step has.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from tokenhaul.config import EngineConfig  # noqa: E402
from tokenhaul.engine.core import EngineCore  # noqa: E402
from tokenhaul.engine.step_calibration import calibration_grid, measure, shape_of  # noqa: E402
from tokenhaul.engine.step_time import StepTimeModel, default_knots  # noqa: E402
from tokenhaul.llm import LLM  # noqa: E402

HELD_OUT = {"6 decodes @300": [(299, 1, True)] * 6,
            "first chunk of 48": [(0, 48, False)],
            "3 decodes @200 + chunk 40@100": [(199, 1, True)] * 3 + [(100, 40, True)],
            "decodes @40,60,900,1000": [(39, 1, True), (59, 1, True), (899, 1, True), (999, 1, True)],
            "2 decodes @500": [(499, 1, True)] * 2}


def held_out_errors(llm: LLM, repeats: int) -> tuple[dict[str, tuple[float, float]], StepTimeModel]:
    """name → (predicted s, measured s) under the held-out scale, and the fitted model."""
    cfg = EngineConfig(model=llm.files.name, dtype="fp32", num_kv_blocks=80, block_size=16,
                       max_num_batched_tokens=64, max_num_seqs=8, max_model_len=1024)
    core = EngineCore(cfg, llm.model)
    sc = core.scheduler.config
    grid = calibration_grid(sc.max_num_batched_tokens, sc.max_num_seqs, sc.max_model_len)
    seconds = measure(core, grid + list(HELD_OUT.values()), repeats=repeats)
    model = StepTimeModel.fit([shape_of(g, 16) for g in grid], seconds[:len(grid)], default_knots(64))
    measured = dict(zip(HELD_OUT, seconds[len(grid):]))
    ratios = {n: model.predict(shape_of(c, 16)) / measured[n] for n, c in HELD_OUT.items()}
    model.scale = math.exp(statistics.fmean(math.log(r) for r in ratios.values()))
    return {n: (model.predict(shape_of(c, 16)), measured[n]) for n, c in HELD_OUT.items()}, model


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--json", type=Path, help="also write the rows here")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    rows, model = held_out_errors(LLM(args.model, dtype="fp32"), args.repeats)
    print(f"{args.model}, fp32, {args.threads} thread(s), fastest of {args.repeats}; scale {model.scale:.2f}")
    print(f"fit: {model.describe()}")
    print("| held-out batch | predicted ms | measured ms | error | within 20 % |\n|---|---|---|---|---|")
    for name, (pred, meas) in rows.items():
        err = pred / meas - 1
        print(f"| {name} | {pred * 1e3:.1f} | {meas * 1e3:.1f} | {err:+.1%} | {'yes' if abs(err) <= 0.2 else 'NO'} |")
    if args.json:
        args.json.write_text(json.dumps({"model": args.model, "threads": args.threads, "scale": model.scale,
                                         "rows": {n: {"predicted_s": p, "measured_s": m}
                                                  for n, (p, m) in rows.items()}}, indent=1))


if __name__ == "__main__":
    main()
