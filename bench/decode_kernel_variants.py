"""Variants of the decode attention kernel (kv/decode_attention.cpp) side by side in one process: each built from a
git revision's source or the working tree, with -D flags, as its own op namespace, then timed interleaved over
SmolLM2- or Qwen2.5-0.5B-shaped bf16 caches (one per layer, 30 / 24 layers, blocks of 16 shuffled in the pool),
B sequences of about `--context` keys, for each KV dtype of `--kv` (bf16; int8 with per-token scales). Prints ms
per step (all layers; median and best of the passes), the K/V read rate, and each variant's largest output
difference from the first of the same KV dtype. `--evict MB` reads that many MB of another
buffer before each layer's call (untimed), as a decode step's weight stream does: the keys then come from DRAM.

    flock -x /tmp/tokenhaul-bench.lock .venv/bin/python bench/decode_kernel_variants.py before=@HEAD~1 now=.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

import torch
from torch.utils.cpp_extension import load

from tokenhaul import native
from tokenhaul.kv.int8 import quantize  # per-token-per-head scales, as the int8 cache stores them

ROOT = Path(__file__).resolve().parent.parent
SOURCE = "tokenhaul/kv/decode_attention.cpp"
SHAPES = {"smollm2-135m": (3, 3, 64, 30), "qwen2.5-0.5b": (2, 7, 64, 24)}  # KV heads, queries per KV head, D, layers


def build(name: str, spec: str, workdir: Path):
    """One variant's ops (`decode_bf16`, `decode_int8`), built under its own namespace (and C shim names)."""
    source, _, flags = spec.partition(":")
    text = (subprocess.run(["git", "show", f"{source[1:]}:{SOURCE}"], cwd=ROOT, check=True, capture_output=True,
                           text=True).stdout if source.startswith("@") else (ROOT / SOURCE).read_text())
    namespace = f"decode_variant_{name}"
    file = workdir / f"{namespace}.cpp"
    file.write_text(text.replace("tokenhaul_kv", namespace).replace("aoti_torch_cpu_decode", f"{namespace}_shim"))
    load(namespace, [str(file)], extra_cflags=[*native._flags()[1], "-fopenmp", *flags.split()],
         is_python_module=False)
    return getattr(torch.ops, namespace)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("variants", nargs="+", help="NAME=SOURCE[:FLAGS], SOURCE @REVISION or . (the working tree)")
    ap.add_argument("--shapes", choices=sorted(SHAPES), default="smollm2-135m")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--context", type=int, default=4096)
    ap.add_argument("--passes", type=int, default=15)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--kv", default="bf16", help="KV dtypes, comma-separated: bf16, int8")
    ap.add_argument("--evict", type=float, default=0.0, help="MB read between two layers' calls (untimed)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as tmp:
        ops = {name: build(name, spec, Path(tmp)) for name, spec in (v.split("=", 1) for v in args.variants)}
    hkv, groups, d, layers = SHAPES[args.shapes]
    B, bs = args.batch, 16
    nb = -(-args.context // bs)
    pool = B * nb + 4
    kvs = args.kv.split(",")
    bf16 = [tuple(torch.randn(pool, bs, hkv, d).bfloat16() for _ in range(2)) for _ in range(layers)]
    caches = {"bf16": bf16} if "bf16" in kvs else {}
    if "int8" in kvs:
        caches["int8"] = [(*quantize(k.float()), *quantize(v.float())) for k, v in bf16]
    tables = [torch.randperm(pool)[:B * nb].view(B, nb) for _ in range(layers)]
    q = torch.randn(B, hkv, groups, d)
    ends = torch.tensor([args.context - 7 * i for i in range(B)])
    mask = (torch.arange(nb * bs)[None, :] < ends[:, None]).contiguous()
    piece = int(args.evict * 2 ** 18)  # fp32 values read before each call
    stream = torch.ones(max(1, piece * 64))  # 64 slices: a slice read again is no longer cached
    def call(ops, kv: str, cache: tuple[torch.Tensor, ...], table: torch.Tensor) -> torch.Tensor:
        if kv == "int8":
            return ops.decode_int8(q, *cache, table, mask, d ** -0.5, 2)
        return ops.decode_bf16(q, *cache, table, mask, d ** -0.5, 2)

    runs = [(name, kv) for name in ops for kv in caches]
    times: dict[tuple[str, str], list[float]] = {run: [] for run in runs}
    for _ in range(args.passes):
        for name, kv in runs:  # interleaved: the host's drift hits every variant alike
            total = 0.0
            for i, (cache, table) in enumerate(zip(caches[kv], tables)):
                if piece:
                    stream[(i % 64) * piece:(i % 64 + 1) * piece].sum()
                t = time.perf_counter()
                call(ops[name], kv, cache, table)
                total += time.perf_counter() - t
            times[name, kv].append(total)
    outs = {(name, kv): call(ops[name], kv, caches[kv][0], tables[0]) for name, kv in runs}
    print(f"decode attention, {args.shapes} shapes, {B} × {args.context} keys, {layers} layers, {args.threads} "
          f"threads, {args.evict:g} MB read between calls")
    print("| variant | KV | ms per step (median / best) | K/V GB/s | largest difference |\n|---|---|---|---|---|")
    for name, kv in runs:
        ts = times[name, kv]
        med = statistics.median(ts)
        row_bytes = hkv * d * 2 * 2 if kv == "bf16" else hkv * (d + 4) * 2  # K and V of a token, scales included
        kv_bytes = int(ends.sum()) * row_bytes * layers
        first = outs[runs[0][0], kv]
        print(f"| {name} | {kv} | {med * 1e3:.2f} / {min(ts) * 1e3:.2f} | {kv_bytes / med / 1e9:.1f} | "
              f"{(outs[name, kv] - first).abs().max().item():.3g} |")


if __name__ == "__main__":
    main()
