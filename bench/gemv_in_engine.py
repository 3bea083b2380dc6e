"""Do the packed GEMVs cost more inside the engine than back to back? SmolLM2 batch-1 decode, 2 threads.

Times every int4 / int8 linear call of a generation with perf_counter (no profiler), replays one decode
step's calls back to back with the same inputs, and runs the engine with the linears replaced by their
cached outputs (the step without its GEMVs). Prints per-call medians and ms per step for each.

    GOMP_SPINCOUNT=10000 flock -x /tmp/tokenhaul-bench.lock .venv/bin/python bench/gemv_in_engine.py

Set the OpenMP wait policy in the environment: torch (and libgomp) load before tokenhaul could choose it.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from tokenhaul import LLM, SamplingParams
from tokenhaul.layers.linear_int4 import Int4Linear
from tokenhaul.layers.linear_int8 import Int8Linear

PROMPT = "The history of the city begins with a small settlement on the river, where"
KINDS = (Int4Linear, Int8Linear)


def decode_tok_s(llm: LLM, new: int) -> float:
    """Decode tokens/s: a generation of `new` tokens minus one of a single token (the prefill)."""
    def run(n: int) -> float:
        t = time.perf_counter()
        llm.generate([PROMPT], SamplingParams(max_tokens=n, temperature=0, ignore_eos=True))
        return time.perf_counter() - t
    return (new - 1) / (run(new) - run(1))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--new-tokens", type=int, default=65)
    args = ap.parse_args()
    torch.set_num_threads(2)
    llm = LLM(args.model, compile="off")  # eager: each linear is a Python call to time
    decode_tok_s(llm, args.new_tokens)
    engine = statistics.median(decode_tok_s(llm, args.new_tokens) for _ in range(3))

    calls: list[tuple[object, torch.Tensor, float]] = []
    originals = {cls: cls.__call__ for cls in KINDS}

    def timed(cls):
        def call(self, x):
            t = time.perf_counter()
            y = originals[cls](self, x)
            calls.append((self, x, time.perf_counter() - t))
            return y
        return call

    for cls in KINDS:
        cls.__call__ = timed(cls)
    llm.generate([PROMPT], SamplingParams(max_tokens=args.new_tokens, temperature=0, ignore_eos=True))
    for cls in KINDS:
        cls.__call__ = originals[cls]
    per_step = len(llm.model.layers) * 4 + 1
    step = [c for c in calls if c[1].shape[0] == 1][-per_step:]
    in_engine = {cls.__name__: statistics.median(t for lin, x, t in calls if type(lin) is cls and x.shape[0] == 1)
                 for cls in KINDS}

    def replay() -> float:
        t = time.perf_counter()
        for lin, x, _ in step:
            lin(x)
        return time.perf_counter() - t

    replay()
    loop = statistics.median(replay() for _ in range(20))
    loop_calls: dict[str, list[float]] = {}
    for _ in range(10):
        for lin, x, _ in step:
            t = time.perf_counter()
            lin(x)
            loop_calls.setdefault(type(lin).__name__, []).append(time.perf_counter() - t)

    outs = {id(lin): lin(x) for lin, x, _ in step}
    for cls in KINDS:
        cls.__call__ = lambda self, x, cls=cls: outs[id(self)] if x.shape[0] == 1 else originals[cls](self, x)
    without = statistics.median(decode_tok_s(llm, args.new_tokens) for _ in range(3))
    for cls in KINDS:
        cls.__call__ = originals[cls]

    print("| | int4 call µs | int8 call µs | ms per step |\n|---|---|---|---|")
    print(f"| in the engine (perf_counter per call) | {in_engine['Int4Linear'] * 1e6:.1f} | "
          f"{in_engine['Int8Linear'] * 1e6:.1f} | step {1e3 / engine:.2f} ({engine:.1f} tok/s) |")
    print(f"| one step's calls replayed back to back | "
          f"{statistics.median(loop_calls['Int4Linear']) * 1e6:.1f} | "
          f"{statistics.median(loop_calls['Int8Linear']) * 1e6:.1f} | GEMVs {loop * 1e3:.2f} |")
    print(f"| engine step with the GEMVs replaced by cached outputs | | | {1e3 / without:.2f} "
          f"→ GEMVs cost {1e3 / engine - 1e3 / without:.2f} in the engine |")


if __name__ == "__main__":
    main()
