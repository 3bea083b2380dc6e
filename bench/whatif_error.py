"""How wrong is the what-if model here? Calibrate this machine's device, then predict and measure TPOT and
prefill throughput over a grid (models × quantizations × batch sizes × context lengths) in the same run.

    flock /tmp/tokenhaul-bench.lock python bench/whatif_error.py
    flock /tmp/tokenhaul-bench.lock python bench/whatif_error.py --device cuda   # where a GPU exists

`--device cuda` calibrates `this-machine-cuda` (the GPU's memory, its kernels timed with CUDA events, the
engine's launch and Python overheads on it) and runs the engine there; without a GPU it refuses in one line.

Run it on quiet cores and without OMP_WAIT_POLICY / GOMP_SPINCOUNT in the environment (or with the
same ones as the runs to be predicted): the calibration measures whatever wait policy is in force.

Measured: the real engine's ledger (prefill: tokens / seconds of prefill steps; TPOT: the fastest decode step of
the whole batch, engine stages). Predicted: whatif.workload.predict from the model's config alone (no weights read)
on the `this-machine` (or `this-machine-cuda`) profile measured at the start of the run. Both sides are the best
of `--rounds` passes over the whole grid (fresh prompts each pass), the linear curves timed again before each
pass after the first (`LinearTimes.refresh`, per row count the fastest pass): on a shared host one pass can catch a
slow spell of the memory bus (36-75 GB/s a second apart on one VM) on either side, passes minutes apart rarely all
do.
Prints one row per point and the MAPE."""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import time

import torch

from tokenhaul.config import EngineConfig
from tokenhaul.errors import TokenhaulError
from tokenhaul.llm import LLM
from tokenhaul.sampling_params import SamplingParams
from tokenhaul.whatif.machine import this_machine
from tokenhaul.whatif.model import StepModel, place
from tokenhaul.whatif.modelspec import load_model_config
from tokenhaul.whatif.workload import Workload, predict, schedule


def measure(llm: LLM, batch: int, context: int, new_tokens: int, seed: int, repeats: int) -> tuple[float, float]:
    """(prefill tokens/s, decode step seconds) of batches of distinct random prompts: the best of
    `repeats` runs (up to 6 while a point has taken under 6 s) for prefill and the fastest decode step of the
    whole batch (engine stages), as calibration takes best times — on a shared machine the
    least-disturbed figure is the reproducible one."""
    g = torch.Generator().manual_seed(seed)
    vocab = llm.costs.lm_head_params // llm.model.config.hidden_size
    params = SamplingParams(max_tokens=new_tokens, temperature=0, ignore_eos=True)
    prefill, decode = 0.0, float("inf")
    t0, runs = time.perf_counter(), 0
    while runs < repeats or (runs < 6 and time.perf_counter() - t0 < 6.0):  # short points: more samples
        runs += 1
        prompts = [torch.randint(100, min(vocab, 30000), (context,), generator=g).tolist() for _ in range(batch)]
        ledger = llm.generate(prompts, params)[0].ledger
        prefill = max(prefill, ledger.prefill.tokens / ledger.prefill.seconds)
        full = [s.seconds for s in ledger.steps if not s.is_prefill and s.num_sampled == batch]
        decode = min([decode] + (full or [s.seconds for s in ledger.steps if not s.is_prefill]))
    return prefill, decode


def full_batch_tpot(w: Workload, hw) -> float:
    """Predicted seconds of a decode step of the whole batch (as measured), averaged over those steps."""
    model = StepModel(hw, w.costs(), w.quantization, place(hw, w.resident_weight_bytes, w.resident_kv_bytes),
                      w.block_size)
    times = [model.step(chunks, sampled, view).seconds for chunks, sampled, view in schedule(w)
             if len(chunks) == w.batch and all(n == 1 for _, n in chunks)]
    return sum(times) / len(times) if times else predict(w, hw).tpot_s


def workload(engine: tuple, quant: str, batch: int, ctx: int, new_tokens: int) -> Workload:
    """The grid point as the what-if model sees it, with the scheduler limits of `engine` (name, config, LLM)."""
    name, cfg, llm = engine
    return Workload(name, cfg, batch, ctx, new_tokens, quant, "bf16",
                    max_batched_tokens=llm.config.max_num_batched_tokens, block_size=llm.config.block_size)


def engine_kwargs(quant: str, device: str) -> dict:
    """bf16 / fp32: dense weights at that dtype (quantization none); int8 / int4: packed, bf16 activations.
    Eager steps throughout: `this-machine`'s overheads are fitted on the eager engine, and a compiled
    batch-1 decode step (engine/compiled_decode.py) is not modelled."""
    eager = {"compile": "off"} if "compile" in {f.name for f in dataclasses.fields(EngineConfig)} else {}
    if quant in ("bf16", "fp32"):
        return {"dtype": quant, "device": device, "quantization": "none"} | eager
    return {"dtype": "bf16", "quantization": quant, "device": device} | eager


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default="smollm2-135m,qwen2.5-coder-0.5b")
    ap.add_argument("--quantizations", default="bf16,int4")
    ap.add_argument("--batches", default="1,4,8")
    ap.add_argument("--contexts", default="16,64,192")
    ap.add_argument("--new-tokens", type=int, default=8)
    ap.add_argument("--repeats", type=int, default=3, help="engine runs per point in each pass (best kept)")
    ap.add_argument("--rounds", type=int, default=3, help="passes over the whole grid (best of them kept)")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--json", default=None, help="also write every point to this file")
    args = ap.parse_args()
    t0 = time.perf_counter()
    try:
        hw = this_machine(remeasure=True, device=args.device)  # refuses first where the device is missing
    except TokenhaulError as e:
        raise SystemExit(f"whatif_error: {e}") from None
    rates = ", ".join(f"{k} {v / 1e9:.0f}" for k, v in hw.flops.items())
    print(f"calibrated {hw.name}: {hw.description} in {time.perf_counter() - t0:.0f} s: {hw.tiers[-1].name} "
          f"{hw.tiers[-1].bandwidth / 1e9:.1f} GB/s, GFLOP/s {rates}")
    grid = [(model, quant, batch, ctx) for model in args.models.split(",") for quant in args.quantizations.split(",")
            for batch in map(int, args.batches.split(",")) for ctx in map(int, args.contexts.split(","))]
    engines, measured = {}, {}
    for r in range(args.rounds):
        if r:
            hw.linear_times.refresh()
        for model, quant, batch, ctx in grid:
            if (model, quant) not in engines:
                name, cfg = load_model_config(model)
                llm = LLM(model, **engine_kwargs(quant, args.device))
                llm.generate("Warm up the kernels.", SamplingParams(max_tokens=2))
                engines[model, quant] = (name, cfg, llm)
            w = workload(engines[model, quant], quant, batch, ctx, args.new_tokens)
            full_batch_tpot(w, hw)  # the first pass times the curves it needs here, between the engine's points
            seed = batch * 1000 + ctx + 7919 * r  # fresh prompts each pass (no prefix cache hits)
            pre, tpot = measure(engines[model, quant][2], batch, ctx, args.new_tokens, seed, args.repeats)
            old_pre, old_tpot = measured.get((model, quant, batch, ctx), (0.0, float("inf")))
            measured[model, quant, batch, ctx] = (max(pre, old_pre), min(tpot, old_tpot))
        print(f"pass {r + 1} of {args.rounds} done at {time.perf_counter() - t0:.0f} s", flush=True)
    print("| model | quant | batch | ctx | prefill tok/s pred | meas | err | TPOT ms pred | meas | err |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    errs, rows = [], []
    for model, quant, batch, ctx in grid:
        name = engines[model, quant][0]
        w = workload(engines[model, quant], quant, batch, ctx, args.new_tokens)
        pred, pred_tpot = predict(w, hw), full_batch_tpot(w, hw)
        pre, tpot = measured[model, quant, batch, ctx]
        e_pre, e_tpot = pred.prefill_tokens_per_s / pre - 1, pred_tpot / tpot - 1
        errs += [abs(e_pre), abs(e_tpot)]
        rows.append(dict(model=name, quant=quant, batch=batch, context=ctx, prefill_pred=pred.prefill_tokens_per_s,
                         prefill_meas=pre, tpot_pred=pred_tpot, tpot_meas=tpot))
        print(f"| {name} | {quant} | {batch} | {ctx} | {pred.prefill_tokens_per_s:.0f} | {pre:.0f} | "
              f"{e_pre:+.0%} | {pred_tpot * 1e3:.1f} | {tpot * 1e3:.1f} | {e_tpot:+.0%} |", flush=True)
    print(f"\n{len(rows)} points, {len(errs)} errors: MAPE {statistics.mean(errs):.1%}, worst {max(errs):.1%}, "
          f"points worse than 25 %: {sum(e > 0.25 for e in errs)} (target: MAPE <= 10 %, none > 25 %); "
          f"{args.rounds} passes, run took {time.perf_counter() - t0:.0f} s")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": args.device, "profile": hw.name, "description": hw.description,
                       "rounds": args.rounds, "points": rows}, f, indent=1)


if __name__ == "__main__":
    main()
