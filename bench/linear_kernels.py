"""Packed linears at M rows, 2 threads: the kernel choices behind `Int8Linear.packed_rows` and
`Int4Linear.max_rows`.

int8 per-channel: `_weight_int8pack_mm` (bf16 activations) vs the integer GEMM `torch._int_mm` with 8-bit
activations (one int8 row per row) or 16-bit (two int8 rows per row, the engine's) vs dequantize + bf16 GEMM,
on the SmolLM2 / Qwen2.5-0.5B lm_heads and Qwen's int8 layers. int4 group 32: the C++ GEMV (int4_gemv.cpp)
vs `_weight_int4pack_mm_for_cpu` per layer linear at 1-4 rows (GB/s of packed weights + scales read), and
int4pack vs `dense_t()` (C++ dequantization) + bf16 GEMM over one layer's four linears. Each time is the median
over enough distinct copies of the weights to miss the 32 MiB L3.

    flock -x /tmp/tokenhaul-bench.lock .venv/bin/python bench/linear_kernels.py
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from tokenhaul.layers.linear_int4 import Int4Linear
from tokenhaul.layers.linear_int8 import Int8Linear, quantize_rows

SHAPES = {"smollm2 lm_head": (49152, 576), "qwen lm_head": (151936, 896), "qwen qkv": (1152, 896),
          "qwen down": (896, 4864)}
LAYERS = {"smollm2 layer": [(960, 576), (576, 576), (3072, 576), (576, 1536)],
          "qwen layer": [(1152, 896), (896, 896), (9728, 896), (896, 4864)]}
CPU = torch.device("cpu")


def median_ms(calls, repeats: int) -> float:
    """Median over `repeats` of the time of one pass over `calls`, divided by the calls' copies."""
    for f in calls:
        f()
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        for f in calls:
            f()
        times.append(time.perf_counter() - t)
    return statistics.median(times) * 1e3


def int4_gemv_table(rows: list[int]) -> None:
    """The C++ GEMV against int4pack on each layer linear, ~100 MB of distinct copies per shape."""
    from tokenhaul.layers import int4_gemv

    assert int4_gemv.available(), "int4_gemv.cpp did not build"
    print("\n| int4 linear | rows | int4pack µs | GB/s | C++ GEMV µs | GB/s | int4pack ÷ GEMV | GEMV fp32 x µs |")
    print("|---|---|---|---|---|---|---|---|")
    ratios = {m: [] for m in rows}
    for layer, shapes in LAYERS.items():
        for (n, k), part in zip(shapes, ("qkv", "o", "gate_up", "down"), strict=True):
            copies = max(2, int(100e6 // (n * k * 5 // 8)))
            lins = [Int4Linear.build([torch.randn(n, k) * 0.02], None, torch.bfloat16, CPU, 32) for _ in range(copies)]
            nbytes = lins[0].weight.numel() + lins[0].scales_zeros.numel() * 2
            for m in rows:
                x = torch.randn(m, k).bfloat16()
                pack = [lambda x=x, w=lin.torch_codes(), sz=lin.torch_scales():
                        torch.ops.aten._weight_int4pack_mm_for_cpu(x, w, 32, sz) for lin in lins]
                gemv = [lambda lin=lin, x=x: torch.ops.tokenhaul_int4.gemv(x, lin.weight, lin.scales_zeros, 32,
                                                                            lin.block)
                        for lin in lins]
                xf = x.float()  # fp32 activations: the FMA path (AVX2 bf16 activations take the 8-bit one)
                wide = [lambda lin=lin, xf=xf: torch.ops.tokenhaul_int4.gemv(xf, lin.weight, lin.scales_zeros, 32,
                                                                              lin.block) for lin in lins]
                p, g = median_ms(pack, 9) / copies * 1e3, median_ms(gemv, 9) / copies * 1e3
                f = median_ms(wide, 9) / copies * 1e3
                ratios[m].append(p / g)
                print(f"| {layer.split()[0]} {part} {n}×{k} | {m} | {p:.1f} | {nbytes / p / 1e3:.1f} | {g:.1f} | "
                      f"{nbytes / g / 1e3:.1f} | {p / g:.2f}× | {f:.1f} |", flush=True)
    for m, r in ratios.items():
        print(f"rows {m}: int4pack ÷ GEMV, geometric mean {statistics.geometric_mean(r):.2f}×")


def int4_table(rows: list[int]) -> None:
    """int4pack and the C++ GEMV against dequantize-then-GEMM over one layer's linears, 6 distinct copies: where
    `Int4Linear.gemv_rows` and `max_rows` lie."""
    from tokenhaul.layers import int4_gemv

    assert int4_gemv.available(), "int4_gemv.cpp did not build"
    print("\n| int4 | rows | int4pack ms | C++ GEMV ms | dense_t + bf16 GEMM ms | int4pack ÷ dequantized | "
          "GEMV ÷ dequantized |\n|---|---|---|---|---|---|---|")
    for name, shapes in LAYERS.items():
        copies = 6
        lins = [Int4Linear.build([torch.randn(n, k) * 0.02], None, torch.bfloat16, CPU, 32)
                for _ in range(copies) for n, k in shapes]
        for m in rows:
            xs = {k: torch.randn(m, k).bfloat16() for _, k in shapes}
            pack = [lambda lin=lin, x=xs[lin.in_features], w=lin.torch_codes(), sz=lin.torch_scales():
                    torch.ops.aten._weight_int4pack_mm_for_cpu(x, w, lin.group, sz) for lin in lins]
            gemv = [lambda lin=lin, x=xs[lin.in_features]: torch.ops.tokenhaul_int4.gemv(
                x, lin.weight, lin.scales_zeros, lin.group, lin.block) for lin in lins]
            dense = [lambda lin=lin, x=xs[lin.in_features]: x @ lin.dense_t() for lin in lins]
            p, g, d = (median_ms(calls, 5) / copies for calls in (pack, gemv, dense))
            print(f"| {name} | {m} | {p:.3f} | {g:.3f} | {d:.3f} | {p / d:.2f} | {g / d:.2f} |", flush=True)


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
    ap.add_argument("--int4-rows", default="16,32,48,64,128")
    ap.add_argument("--gemv-rows", default="1,2,4")
    ap.add_argument("--only", choices=["int8", "int4", "gemv"], help="one table only")
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    if args.only in (None, "gemv"):
        int4_gemv_table([int(r) for r in args.gemv_rows.split(",")])
    if args.only in (None, "int8"):
        int8_table([int(r) for r in args.rows.split(",")])
    if args.only in (None, "int4"):
        int4_table([int(r) for r in args.int4_rows.split(",")])


def int8_table(rows: list[int]) -> None:
    """int8 per-channel kernels on the lm_heads and Qwen's int8 layers."""
    modes = ["int8pack", "int_mm a8", "int_mm a16", "dequant+bf16"]
    print("| shape | rows | " + " | ".join(f"{m} ms" for m in modes) + " | int8pack ÷ a8 | int8pack ÷ a16 |")
    print("|---|---|" + "---|" * (len(modes) + 2))
    for name, (n, k) in SHAPES.items():
        copies = max(1, int(64e6 // (n * k)))
        lins = [Int8Linear.build([torch.randn(n, k) * 0.02], None, torch.bfloat16, CPU) for _ in range(copies)]
        for m in rows:
            x = torch.randn(m, k).bfloat16()
            res = {}
            for mode in modes:
                if mode == "dequant+bf16" and m < 8:
                    continue
                calls = [lambda f=kernel(lin, mode), x=x: f(x) for lin in lins]
                res[mode] = median_ms(calls, max(3, 12 // copies)) / copies
            cells = " | ".join(f"{res[m]:.3f}" if m in res else "–" for m in modes)
            print(f"| {name} | {m} | {cells} | {res['int8pack'] / res['int_mm a8']:.2f}× | "
                  f"{res['int8pack'] / res['int_mm a16']:.2f}× |", flush=True)


if __name__ == "__main__":
    main()
