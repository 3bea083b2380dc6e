"""The few-row bf16 GEMV (layers/bf16_gemv.cpp) against torch's bf16 `F.linear`, side by side: all 121 SmolLM2-shaped
projections (the lm_head included) with distinct random weights (269 MB), M rows, a 1 GiB write before each timed
pass (weights from DRAM, not a large L3), best of 5, 2 threads; GB/s of weight read, and the largest difference from
fp32 sums.

    flock -x /tmp/tokenhaul-bench.lock .venv/bin/python bench/bf16_gemv.py [--rows 1,2,4,8,16]
"""

from __future__ import annotations

import argparse
import time

import torch

from tokenhaul.layers import bf16_gemv

SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536)] * 30 + [(49152, 576)]  # (out, in)


def best_s(fn, flush: torch.Tensor, passes: int = 5) -> float:
    best = float("inf")
    for _ in range(passes):
        flush += 1
        t = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t)
    return best


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", default="1,2,4,8,16")
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    if not bf16_gemv.available():
        raise SystemExit("the bf16 GEMV did not build")
    g = torch.Generator().manual_seed(0)
    ws = [torch.randn(o, i, generator=g).bfloat16() for o, i in SHAPES]
    mb = sum(w.nbytes for w in ws) / 1e6
    flush = torch.zeros(1 << 28)
    gemv, linear = torch.ops.tokenhaul_bf16.bf16_gemv, torch.nn.functional.linear
    print(f"{len(ws)} SmolLM2-shaped bf16 linears, {mb:.0f} MB, {args.threads} threads\n")
    print("| rows | F.linear ms (GB/s) | GEMV ms (GB/s) | F.linear ÷ GEMV | GEMV max error vs fp32 |")
    print("|---|---|---|---|---|")
    for m in (int(r) for r in args.rows.split(",")):
        xs = {i: torch.randn(m, i, generator=g).bfloat16() for _, i in SHAPES}
        t_lin = best_s(lambda xs=xs: [linear(xs[w.shape[1]], w) for w in ws], flush)
        t_gemv = best_s(lambda xs=xs: [gemv(xs[w.shape[1]], w) for w in ws], flush)
        err = max(float((gemv(xs[w.shape[1]], w) - xs[w.shape[1]].float() @ w.float().t()).abs().max())
                  for w in ws[:4])
        print(f"| {m} | {t_lin * 1e3:.1f} ({mb / 1e3 / t_lin:.1f}) | {t_gemv * 1e3:.1f} ({mb / 1e3 / t_gemv:.1f}) | "
              f"{t_lin / t_gemv:.2f}× | {err:.1e} |")


if __name__ == "__main__":
    main()
