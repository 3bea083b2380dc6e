"""The gathered (sparse) GEMV against each format's dense GEMV at one bf16 row, over a sweep of sparsities: all
121 SmolLM2-shaped projections (or 96 Qwen2.5-0.5B-shaped ones) with distinct weights, best of 7, GB/s of what
each read (the sparse kernels' own count). A 1 GiB buffer is written before each timed pass, so neither kernel finds
the other's (or its own last) weights in a large L3 (480 MiB on one Xeon host: without it the gathered kernel read
1.5x faster after a pass over the same rows).

    flock -x /tmp/tokenhaul-bench.lock .venv/bin/python bench/sparse_gemv.py [smol|qwen] [bf16,int8,int4] [0,0.4,0.7]
"""

import sys
import time

import torch

from tokenhaul.layers.linear_dense import DenseLinear
from tokenhaul.layers.linear_int4 import Int4Linear
from tokenhaul.layers.linear_int8 import Int8Linear
from tokenhaul.layers.linear_sparse import SparseLinear

CPU = torch.device("cpu")
SHAPES = {"smol": [(576, 960), (576, 576), (576, 3072), (1536, 576)] * 30 + [(576, 49152)],
          "qwen": [(896, 1152), (896, 896), (896, 9728), (4864, 896)] * 24}
BUILDS = {"bf16": lambda w: DenseLinear.build([w], None, torch.bfloat16, CPU),
          "int8": lambda w: Int8Linear.build([w], None, torch.bfloat16, CPU),
          "int4": lambda w: Int4Linear.build([w], None, torch.bfloat16, CPU, 32)}


def main() -> None:
    model = sys.argv[1] if len(sys.argv) > 1 else "smol"
    formats = (sys.argv[2] if len(sys.argv) > 2 else "int8,int4").split(",")
    sparsities = [float(v) for v in (sys.argv[3] if len(sys.argv) > 3 else "0,0.4,0.7").split(",")]
    shapes = SHAPES[model]
    flush = torch.zeros(1 << 28)
    print("| kernel | sparsity | dense ms (GB/s) | gathered ms (GB/s) | dense / gathered |\n|---|---|---|---|---|")
    for name in formats:
        dense = [BUILDS[name](torch.randn(o, i) * 0.05) for i, o in shapes]
        sparse = [SparseLinear.wrap(d, 0.0, max_rows=64) for d in dense]
        xs = [torch.randn(1, i).to(torch.bfloat16) for i, _ in shapes]
        for s in sparsities:
            for lin, x in zip(sparse, xs):
                lin.threshold = float(torch.quantile(x.float().abs().flatten(), s)) if s else 0.0
            best = {"d": 1e9, "s": 1e9}
            for _ in range(7):
                for key, lins in (("d", dense), ("s", sparse)):
                    flush.add_(1)
                    t = time.perf_counter()
                    for lin, x in zip(lins, xs):
                        lin(x)
                    best[key] = min(best[key], time.perf_counter() - t)
            for lin in sparse:
                lin.touched_bytes = 0
            for lin, x in zip(sparse, xs):
                lin(x)
            read, full = sum(lin.touched_bytes for lin in sparse), sum(lin.weight_bytes for lin in sparse)
            print(f"| {name} | {s} | {best['d'] * 1e3:.2f} ({full / best['d'] / 1e9:.1f}) | "
                  f"{best['s'] * 1e3:.2f} ({read / best['s'] / 1e9:.1f}) | {best['d'] / best['s']:.2f} |", flush=True)


if __name__ == "__main__":
    main()
