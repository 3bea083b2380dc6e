"""int8 per-channel linears at M rows, 2 threads: `_weight_int8pack_mm` (bf16 activations) vs the integer
GEMM `torch._int_mm` with 8-bit activations (one int8 row per row) or 16-bit (two int8 rows per row) vs
dequantize + bf16 GEMM. Shapes: the SmolLM2 / Qwen2.5-0.5B lm_heads and Qwen's int8 layers; each time is the
median of repeated calls over enough distinct copies of the weight to miss the 32 MiB L3.

    flock -x /tmp/tokenhaul-bench.lock .venv/bin/python bench/int8_kernels.py
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from tokenhaul.layers.linear_int8 import Int8Linear, quantize_rows

SHAPES = {"smollm2 lm_head": (49152, 576), "qwen lm_head": (151936, 896), "qwen qkv": (1152, 896),
          "qwen down": (896, 4864)}
CPU = torch.device("cpu")


def kernel(lin: Int8Linear, mode: str):
    """One call of `lin` through `mode`, whatever the row count."""
    if mode == "int8pack":
        return lambda x: torch.ops.aten._weight_int8pack_mm(x.bfloat16(), lin.weight, lin.scales)
    if mode == "dequant+bf16":
        return lambda x: torch.nn.functional.linear(x.bfloat16(), lin.dequantize(torch.bfloat16))
    if mode == "int_mm a8":  # one int8 row per activation row (not the engine's: too coarse for an lm_head)
        def a8(x):
            xq, xs = quantize_rows(x, split=False)
            return torch._int_mm(xq, lin.weight_t).float().mul_(xs).mul_(lin.scales)
        return a8
    forced = Int8Linear(lin.weight, lin.scales, None)  # the engine's integer path at every row count
    forced.packed_rows = 0
    return forced


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--rows", default="1,2,4,8,32,64")
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    modes = ["int8pack", "int_mm a8", "int_mm a16", "dequant+bf16"]
    print("| shape | rows | " + " | ".join(f"{m} ms" for m in modes) + " | int8pack ÷ a8 | int8pack ÷ a16 |")
    print("|---|---|" + "---|" * (len(modes) + 2))
    for name, (n, k) in SHAPES.items():
        copies = max(1, int(64e6 // (n * k)))
        lins = [Int8Linear.build([torch.randn(n, k) * 0.02], None, torch.bfloat16, CPU) for _ in range(copies)]
        for m in (int(r) for r in args.rows.split(",")):
            x = torch.randn(m, k).bfloat16()
            res = {}
            for mode in modes:
                if mode == "dequant+bf16" and m < 8:
                    continue
                fs = [kernel(lin, mode) for lin in lins]
                for f in fs:
                    f(x)
                times = []
                for _ in range(max(3, 12 // copies)):
                    t = time.perf_counter()
                    for f in fs:
                        f(x)
                    times.append((time.perf_counter() - t) / copies)
                res[mode] = statistics.median(times) * 1e3
            cells = " | ".join(f"{res[m]:.3f}" if m in res else "–" for m in modes)
            print(f"| {name} | {m} | {cells} | {res['int8pack'] / res['int_mm a8']:.2f}× | "
                  f"{res['int8pack'] / res['int_mm a16']:.2f}× |", flush=True)


if __name__ == "__main__":
    main()
