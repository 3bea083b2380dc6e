"""bf16 vs fp32 GEMM on this CPU, and what the engine's many-row linears do about it (layers/linear.py
`low_precision_gemm_is_fast`): one 576 x 3072 weight (SmolLM2's gate/up) at M rows, `x @ w` ([K, N] weight) and
`F.linear` ([N, K] weight), median of 10 calls, 2 threads; then the engine's bf16 and int4 linears over all 120
SmolLM2-shaped layer weights (distinct, random) at M rows, best of 3.

    flock -x /tmp/tokenhaul-bench.lock .venv/bin/python bench/bf16_gemm.py

Without oneDNN's bf16 GEMM (AVX-512; `torch.ops.mkldnn._is_mkldnn_bf16_supported()`), torch 2.13 runs bf16
GEMMs as a fallback loop; the engine then widens many-row GEMMs to fp32 (FP32_GEMM_ROWS and up)."""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F

from tokenhaul.layers.linear_dense import DenseLinear
from tokenhaul.layers.linear_int4 import Int4Linear


def median_s(fn, n: int = 10) -> float:
    fn()
    times = []
    for _ in range(n):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def call_each(lins: list, xs: list[torch.Tensor]) -> None:
    for lin, x in zip(lins, xs):  # each output dropped at once, as in the engine
        lin(x)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    print(f"torch {torch.__version__}, capability {torch.backends.cpu.get_cpu_capability()}, oneDNN bf16 GEMM "
          f"{torch.ops.mkldnn._is_mkldnn_bf16_supported()}, {args.threads} threads")
    k, n = 576, 3072
    print("\n| rows | fp32 x @ w | fp32 F.linear | bf16 x @ w | bf16 F.linear | GFLOP/s (same order) |")
    print("|---|---|---|---|---|---|")
    for m in (1, 8, 32, 64, 128, 512):
        cells, rates = [], []
        for dt in (torch.float32, torch.bfloat16):
            x, w = torch.randn(m, k).to(dt), torch.randn(k, n).to(dt)
            wt = w.t().contiguous()
            for fn in (lambda x=x, w=w: x @ w, lambda x=x, wt=wt: F.linear(x, wt)):
                s = median_s(fn)
                cells.append(f"{s * 1e3:.2f} ms")
                rates.append(f"{2 * m * k * n / s / 1e9:.1f}")
        print(f"| {m} | {' | '.join(cells)} | {' / '.join(rates)} |", flush=True)
    cpu = torch.device("cpu")
    shapes = [(576, 960), (576, 576), (576, 3072), (1536, 576)] * 30
    ws = [torch.randn(o, i) * 0.05 for i, o in shapes]
    lins = {"bf16": [DenseLinear.build([w], None, torch.bfloat16, cpu) for w in ws],
            "int4": [Int4Linear.build([w], None, torch.bfloat16, cpu, 32) for w in ws]}
    print("\n| rows | engine bf16 linears ms | engine int4 linears ms |\n|---|---|---|")
    for m in (1, 8, 32, 64, 128):
        xs = [torch.randn(m, i).bfloat16() for i, _ in shapes]
        best = {}
        for name, ls in lins.items():
            best[name] = min(median_s(lambda ls=ls, xs=xs: call_each(ls, xs), 1) for _ in range(3))
        print(f"| {m} | {best['bf16'] * 1e3:.1f} | {best['int4'] * 1e3:.1f} |", flush=True)


if __name__ == "__main__":
    main()
