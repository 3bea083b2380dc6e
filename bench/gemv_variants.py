"""Variants of a C++ GEMV side by side in one process: the int8, int4 or gathered (sparse-int8 / -int4: activation
sparsity, `--kept` of the inputs over the threshold, GB/s of the rows it reads) kernel built from a git revision's
source or from the working tree, with -D flags, timed interleaved over Qwen2.5-0.5B- or SmolLM2-shaped layers
(`--shapes`) with random weights called in model order (~700 MB by default: beyond a 300 MiB L3), 2 threads.
Prints GB/s (best and median) for the whole sequence and per shape, and the largest output difference between
the variants (0 where a change must not move a bit).

    flock -x /tmp/tokenhaul-bench.lock .venv/bin/python bench/gemv_variants.py --kernel int8 \\
        main=@HEAD~1 now=. runs2=.:-DSTREAMS=2

A variant is NAME=SOURCE[:FLAGS], SOURCE a git revision after @ or "." for the working tree.
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
from tokenhaul.layers.linear_int4 import block_n, unquads
from tokenhaul.layers.linear_sparse import in_parts, part_width
from tokenhaul.layers.weight_block import huge_page_block

ROOT = Path(__file__).resolve().parent.parent
SOURCES = {"int8": "tokenhaul/layers/int8_gemv.cpp", "int4": "tokenhaul/layers/int4_gemv.cpp",
           "sparse-int8": "tokenhaul/layers/sparse_gemv.cpp", "sparse-int4": "tokenhaul/layers/sparse_gemv.cpp"}
NAMESPACES = {"int8": "tokenhaul_int8", "int4": "tokenhaul_int4", "sparse-int8": "tokenhaul_sparse",
              "sparse-int4": "tokenhaul_sparse"}
OPS = {"int8": "int8_gemv", "int4": "gemv", "sparse-int8": "sparse_gemv", "sparse-int4": "sparse_gemv"}
SHAPES = {"qwen2.5-0.5b": [(1152, 896), (896, 896), (9728, 896), (896, 4864)],  # qkv, o, gate_up, down
          "smollm2-135m": [(960, 576), (576, 576), (3072, 576), (576, 1536)],
          "lm-heads": [(151936, 896), (49152, 576)]}  # Qwen2.5-0.5B's and SmolLM2's


def build(kernel: str, name: str, spec: str, workdir: Path):
    """Compile one variant as its own op namespace; returns the op."""
    source, _, flags = spec.partition(":")
    path = SOURCES[kernel]
    text = (subprocess.run(["git", "show", f"{source[1:]}:{path}"], cwd=ROOT, check=True, capture_output=True,
                           text=True).stdout if source.startswith("@") else (ROOT / path).read_text())
    namespace = f"gemv_variant_{kernel.replace('-', '_')}_{name}"
    file = workdir / f"{namespace}.cpp"
    file.write_text(text.replace(NAMESPACES[kernel], namespace))
    engine_flags = native._flags()[1]  # as the engine builds it on this host; a variant's own -D flags come after
    load(namespace, [str(file)], extra_cflags=[*engine_flags, "-fopenmp", *flags.split()], is_python_module=False)
    ops = getattr(torch.ops, namespace)
    return getattr(ops, OPS[kernel]) if hasattr(ops, OPS[kernel]) else ops.gemv  # revisions before the rename


def weights(kernel: str, shapes: list[tuple[int, int]], megabytes: float, rows: int, kept: float,
            threads: int, torch_scales: bool = False) -> list[tuple]:
    """Distinct random layers until `megabytes`, in model order; each entry is the op's arguments."""
    per_layer = sum(n * k for n, k in shapes) * (0.625 if kernel.endswith("int4") else 1)
    layers = max(1, int(megabytes * 1e6 / per_layer))
    out = []
    for _ in range(layers):
        for n, k in shapes:
            x = torch.randn(rows, k).bfloat16()
            threshold = torch.distributions.Normal(0.0, 1.0).icdf(torch.tensor(0.5 + (1 - kept) / 2)).item()
            if kernel == "sparse-int8":  # by input channel, in parts [P, k, w]; fp32 (scale, offset) per channel
                parts = in_parts(torch.randint(0, 256, (k, n), dtype=torch.uint8), part_width(n, threads))
                out.append((x, threshold, parts, torch.rand(k, 2) * 0.01, n, 0, None, torch.zeros(2, dtype=torch.long)))
            elif kernel == "sparse-int4":  # codes [P, k, w / 2]; bf16 (scale, zero) [k / 32, 2, n] per group
                parts = in_parts(torch.randint(0, 256, (k, n // 2), dtype=torch.uint8), part_width(n, threads) // 2)
                out.append((x, threshold, parts, (torch.rand(k // 32, 2, n) * 0.01).bfloat16(), n, 32, None,
                            torch.zeros(2, dtype=torch.long)))
            elif kernel == "int8":
                out.append((x, torch.randint(-128, 128, (n, k), dtype=torch.int8), torch.rand(n).bfloat16() * 0.01))
            else:
                sz = torch.randn(k // 32, n, 2) if torch_scales else torch.randn(n // 64, k // 32, 64, 2)
                out.append((x, torch.randint(0, 256, (n, k // 2), dtype=torch.uint8), (sz * 0.01).bfloat16(), 32,
                            block_n()))
    return out


def in_one_block(calls: list[tuple]) -> list[tuple]:
    """The same calls with every weight tensor copied into one huge-page block as the engine's loader makes it
    (tokenhaul/layers/weight_block.py), 64-byte aligned, in call order."""
    total = sum((t.nbytes + 63) // 64 * 64 for c in calls for t in c[1:] if isinstance(t, torch.Tensor))
    block = huge_page_block(total)
    offset, out = 0, []
    for c in calls:
        moved = []
        for t in c[1:]:
            if isinstance(t, torch.Tensor):
                view = block[offset:offset + t.nbytes].view(t.dtype).view(t.shape)
                view.copy_(t)
                offset += (t.nbytes + 63) // 64 * 64
                t = view
            moved.append(t)
        out.append((c[0], *moved))
    return out


def by_rtt(runs: list[tuple], nbytes: float, seconds: float) -> None:
    """Whole-sequence GB/s per variant, split by the vCPUs' placement read around each pass: a round trip under
    150 ns (one CCD's L3) or over 250 ns (two CCDs); the hypervisor moves them every few seconds on some hosts."""
    with tempfile.TemporaryDirectory() as tmp:
        probe = Path(tmp) / "core_rtt"
        subprocess.run(["cc", "-O2", "-pthread", str(ROOT / "bench/native/core_rtt.c"), "-o", str(probe)], check=True)

        def rtt() -> float:
            return float(subprocess.run([str(probe)], capture_output=True, text=True, check=True).stdout.split()[2])

        rates: dict[str, dict[str, list[float]]] = {name: {"one CCD": [], "two CCDs": []} for name, _, _ in runs}
        end = time.time() + seconds
        while time.time() < end:
            for name, op, variant_calls in runs:
                before, t = rtt(), time.perf_counter()
                for c in variant_calls:
                    op(*c)
                gbs, after = nbytes / (time.perf_counter() - t) / 1e9, rtt()
                if max(before, after) < 150 or min(before, after) > 250:
                    rates[name]["one CCD" if before < 150 else "two CCDs"].append(gbs)
    print("| variant | one CCD: passes, GB/s median | two CCDs: passes, GB/s median |\n|---|---|---|")
    for name, r in rates.items():
        cells = [f"{len(v)}, {statistics.median(v):.1f}" if v else "0, –" for v in r.values()]
        print(f"| {name} | " + " | ".join(cells) + " |")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("variants", nargs="+", help="NAME=SOURCE[:FLAGS]")
    ap.add_argument("--kernel", choices=sorted(SOURCES), default="int8")
    ap.add_argument("--rows", type=int, default=1)
    ap.add_argument("--kept", type=float, default=0.6, help="sparse: share of inputs over the threshold")
    ap.add_argument("--megabytes", type=float, default=700)
    ap.add_argument("--passes", type=int, default=7)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--shapes", choices=sorted(SHAPES), default="qwen2.5-0.5b", help="the layer's linears")
    ap.add_argument("--torch-scales", action="store_true",
                    help="int4: scales in torch's order [K / 32, N, 2] (revisions before the unit order need it)")
    ap.add_argument("--torch-codes", default="", metavar="NAME,...",
                    help="int4: variants that read 32-row blocks in torch's layout (revisions before the quads): "
                         "they get the same weights in that layout")
    ap.add_argument("--by-rtt", type=float, default=0, metavar="SECONDS",
                    help="run passes for SECONDS, each between two probes of the CPU 0 <-> 1 cache-line round trip "
                         "(bench/native/core_rtt.c), and split the GB/s by whether the vCPUs shared a CCD")
    ap.add_argument("--both-orders", action="store_true",
                    help="int4, 64-row blocks: each variant also timed on the same weights with the scales in "
                         "torch's order")
    ap.add_argument("--one-block", action="store_true",
                    help="each variant also timed on the same weights copied into one huge-page block")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as tmp:
        ops = {name: build(args.kernel, name, spec, Path(tmp))
               for name, spec in (v.split("=", 1) for v in args.variants)}
    shapes = SHAPES[args.shapes]
    calls = weights(args.kernel, shapes, args.megabytes, args.rows, args.kept, args.threads, args.torch_scales)

    def read(c: tuple) -> float:  # the bytes a call reads (gathered: its kept rows)
        if args.kernel == "sparse-int8":
            return (c[2].numel() + c[3].numel() * 4) * (c[0].float().abs() >= c[1]).float().mean().item()
        if args.kernel == "sparse-int4":  # kept codes; the scales of every group (at 0.4 nearly all are read)
            return c[2].numel() * (c[0].float().abs() >= c[1]).float().mean().item() + c[3].numel() * 2
        return sum(t.numel() * t.element_size() for t in c[1:3] if isinstance(t, torch.Tensor))

    nbytes = [sum(read(c) for c in calls[i::len(shapes)]) for i in range(len(shapes))]
    old_layout = set(filter(None, args.torch_codes.split(",")))
    old_calls = [(c[0], unquads(c[1]), *c[2:]) for c in calls] if old_layout and block_n() == 32 else calls
    runs = [(name, op, old_calls if name in old_layout else calls) for name, op in ops.items()]
    if args.both_orders:
        torch_order = [(c[0], c[1], c[2].transpose(0, 1).reshape(c[2].shape[1], -1, 2), *c[3:]) for c in calls]
        runs = [run for name, op in ops.items()
                for run in ((f"{name}, unit order", op, calls), (f"{name}, torch order", op, torch_order))]
    if args.one_block:
        block_calls = in_one_block(calls)
        runs = [run for name, op, variant_calls in runs
                for run in ((name, op, variant_calls), (f"{name}, one block", op, block_calls))]
    if args.by_rtt:
        return by_rtt(runs, sum(nbytes), args.by_rtt)
    times = {name: [] for name, _, _ in runs}  # per pass: seconds per shape
    clock = time.perf_counter
    for _ in range(args.passes):
        for name, op, variant_calls in runs:  # interleaved: the host's drift hits every variant alike
            spent = [0.0] * len(shapes)
            for i, c in enumerate(variant_calls):
                t = clock()
                op(*c)
                spent[i % len(shapes)] += clock() - t
            times[name].append(spent)
    print(f"{args.kernel} GEMV, {args.shapes} linears in model order, {args.rows} row(s), {len(calls)} calls, "
          f"{sum(nbytes) / 1e6:.0f} MB, {args.threads} threads, {args.passes} passes; GB/s best / median")
    print("| variant | all | " + " | ".join(f"{n} × {k}" for n, k in shapes) + " |")
    print("|---|---|" + "---|" * len(shapes))
    for name, passes in times.items():
        totals = [sum(p) for p in passes]
        cells = [f"{sum(nbytes) / min(totals) / 1e9:.1f} / {sum(nbytes) / statistics.median(totals) / 1e9:.1f}"]
        for i in range(len(shapes)):
            ts = [p[i] for p in passes]
            cells.append(f"{nbytes[i] / min(ts) / 1e9:.1f} / {nbytes[i] / statistics.median(ts) / 1e9:.1f}")
        print(f"| {name} | " + " | ".join(cells) + " |")
    outs = [op(*variant_calls[0]).float() for _, op, variant_calls in runs]
    print(f"largest difference between variants: {max((o - outs[0]).abs().max().item() for o in outs):g}")


if __name__ == "__main__":
    main()
