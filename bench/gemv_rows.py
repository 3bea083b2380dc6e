"""Batched decode with the packed GEMVs' row limits as they are against a narrower setting, alternated in one
process (the AVX2 host's run-to-run noise is larger than the effect measured across runs).

    flock -x /tmp/tokenhaul-bench.lock .venv/bin/python bench/gemv_rows.py --models smollm2-135m,qwen2.5-coder-0.5b

`--narrow` is the setting before 6d990b2 on AVX2 hosts: the int4 GEMV at 1 row (int4pack to 56, then dequantize
+ fp32 GEMM), the int8 GEMV by its AVX-512 rule (1 row, or a few while M × K <= 4096). Prints decode tok/s from
the ledger's decode steps (eager: batches do not take the compiled batch-1 step) and the ratio."""

from __future__ import annotations

import argparse
import statistics

from tokenhaul.layers.linear_int4 import Int4Linear
from tokenhaul.layers.linear_int8 import Int8Linear
from tokenhaul.llm import LLM
from tokenhaul.sampling_params import SamplingParams


def linears(model) -> list:
    return [model.lm_head] + [getattr(layer, a) for layer in model.layers for a in ("qkv", "o", "gate_up", "down")]


def set_limits(model, narrow: bool, now: dict) -> None:
    """The narrow limits, or the ones the engine chose (`now`, recorded before the first change)."""
    for lin in linears(model):
        if isinstance(lin, Int4Linear):
            lin.set_rows(*((1, 56) if narrow else now[id(lin)]))
        elif isinstance(lin, Int8Linear):
            lin.gemv_max = None if narrow else now[id(lin)]


def decode_rate(llm: LLM, prompts: list[str], params: SamplingParams) -> float:
    steps = [s for s in llm.generate(prompts, params)[0].ledger.steps if not s.is_prefill]
    return sum(s.num_sampled for s in steps) / sum(s.seconds for s in steps)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default="smollm2-135m,qwen2.5-coder-0.5b")
    ap.add_argument("--batches", default="8,32")
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=2)
    args = ap.parse_args()
    print("| model | batch | narrow tok/s | now tok/s | now ÷ narrow |\n|---|---|---|---|---|")
    for name in args.models.split(","):
        llm = LLM(name, compile="off")
        now = {id(lin): (lin.gemv_rows, lin.max_rows) if isinstance(lin, Int4Linear) else getattr(lin, "gemv_max", None)
               for lin in linears(llm.model)}
        params = SamplingParams(max_tokens=args.new_tokens, temperature=0, ignore_eos=True)
        for batch in map(int, args.batches.split(",")):
            prompts = [f"Write a short paragraph about topic number {i}." for i in range(batch)]
            llm.generate(prompts, params)  # warm-up
            rates: dict[bool, list[float]] = {True: [], False: []}
            for _ in range(args.repeats):
                for narrow in (True, False):
                    set_limits(llm.model, narrow, now)
                    rates[narrow].append(decode_rate(llm, prompts, params))
            a, b = statistics.median(rates[True]), statistics.median(rates[False])
            print(f"| {name} | {batch} | {a:.1f} | {b:.1f} | {b / a:.2f}× |", flush=True)
        del llm


if __name__ == "__main__":
    main()
