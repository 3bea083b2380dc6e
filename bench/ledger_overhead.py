"""What recording costs: decode steps with and without the ledger observer, in one process.

Runs alternate (off, on, on, off, ...) so drift on a shared machine hits both modes alike. Figures
per batch size: the A/B ratio of step times, as the median over all steps and as the best run's
median (the steadiest under load; other jobs move either by more than the 2 % budget), and the
observer's own time (on_step + on_token + on_finish, measured inside the calls) as a share of the
step (precise, but blind to building the StepRecord in the core).

    .venv/bin/python bench/ledger_overhead.py --model smollm2-135m --batch 1 --batch 16
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from tokenhaul.ledger.ledger import Ledger
from tokenhaul.llm import LLM
from tokenhaul.sampling_params import SamplingParams
from tokenhaul.text.output_processor import OutputProcessor


class TimedLedger(Ledger):
    """A Ledger that also times its own calls."""

    self_seconds = 0.0

    def on_step(self, record):
        t = time.perf_counter()
        super().on_step(record)
        self.self_seconds += time.perf_counter() - t

    def on_token(self, *args, **kw):
        t = time.perf_counter()
        super().on_token(*args, **kw)
        self.self_seconds += time.perf_counter() - t

    def on_finish(self, request):
        t = time.perf_counter()
        super().on_finish(request)
        self.self_seconds += time.perf_counter() - t


def decode_run(llm: LLM, ledger: Ledger | None, batch: int, steps: int, run: int) -> tuple[list[float], float]:
    """Prefill `batch` requests, then time `steps` decode steps (core step + front end)."""
    core = llm.core
    core.observer = ledger
    front = OutputProcessor(llm.tokenizer, ledger)
    params = SamplingParams(max_tokens=steps + 1, temperature=0, ignore_eos=True)
    for i in range(batch):
        ids = [1000 + (run * 7919 + i * 131 + j * 17) % 40000 for j in range(24)]  # no prefix-cache hits
        core.add_request(f"o{run}-{i}", ids, params)
        front.add(f"o{run}-{i}", ids, params)
    front.process(core.step(), 0)  # prefill
    times = []
    while core.has_unfinished():
        step = core.num_steps
        t = time.perf_counter()
        front.process(core.step(), step)
        times.append(time.perf_counter() - t)
    core.observer = None
    return times, getattr(ledger, "self_seconds", 0.0)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--batch", type=int, action="append", help="decode batch sizes (default 1 and 16)")
    ap.add_argument("--steps", type=int, default=24, help="decode steps per run")
    ap.add_argument("--pairs", type=int, default=4, help="(off, on) pairs per batch size")
    args = ap.parse_args()
    llm = LLM(args.model, threads=args.threads)
    decode_run(llm, None, 1, 4, -1)  # warm up
    print(f"{args.model}, {torch.get_num_threads()} threads, {args.steps} decode steps per run, "
          f"{args.pairs} interleaved pairs")
    print(f"{'batch':>5} {'off ms/step':>12} {'on ms/step':>11} {'on/off':>7} {'best off':>9} {'best on':>8} "
          f"{'on/off':>7} {'tok/s':>6} {'GB/s':>5} {'GFLOP/s':>8} {'observer µs/step':>17} {'share':>7}")
    run = 0
    for batch in args.batch or [1, 16]:
        steps = {"off": [], "on": []}
        best = {"off": float("inf"), "on": float("inf")}
        self_s = []
        for pair in range(args.pairs):
            for mode in (("off", "on") if pair % 2 == 0 else ("on", "off")):
                ledger = TimedLedger(llm.costs) if mode == "on" else None
                times, own = decode_run(llm, ledger, batch, args.steps, run)
                run += 1
                steps[mode] += times
                best[mode] = min(best[mode], statistics.median(times))
                if ledger is not None:
                    self_s.append(own / len(times))  # the prefill step's share is counted in
                    d = ledger.decode
                    per_step = (d.costs.dram_bytes / d.steps, d.costs.flops / d.steps)
        off, on = statistics.median(steps["off"]), statistics.median(steps["on"])
        own = statistics.median(self_s)
        print(f"{batch:>5} {off * 1e3:>12.2f} {on * 1e3:>11.2f} {on / off:>7.3f} {best['off'] * 1e3:>9.2f} "
              f"{best['on'] * 1e3:>8.2f} {best['on'] / best['off']:>7.3f} {batch / best['on']:>6.1f} "
              f"{per_step[0] / best['on'] / 1e9:>5.1f} {per_step[1] / best['on'] / 1e9:>8.1f} "
              f"{own * 1e6:>17.1f} {own / best['on']:>7.3%}")

if __name__ == "__main__":
    main()
