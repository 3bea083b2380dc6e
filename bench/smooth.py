"""Smooth streams: one mixed workload (Poisson arrivals, long and short prompts, streamed) against
`tokenhaul serve` with the inter-token budget off (plain token budget, main's scheduling) and on,
and against llama.cpp's server (xllamacpp) for reference. Same GGUF, same threads, greedy, EOS
ignored (every request streams exactly --output-len tokens), one server at a time.

    flock -x /tmp/tokenhaul-bench.lock .venv/bin/python bench/smooth.py --num-requests 32 --concurrency 24

`--targets 60,90,120` runs the budget-on server once per target (to choose the default by
measurement). Ratios are on / off. The load generator shares the CPU with the server under test.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))
sys.path.insert(0, str(ROOT))

from peers import LlamaCppServer  # noqa: E402
from serve_vs_llamacpp import tokenhaul_server  # noqa: E402

from tokenhaul.bench import loadgen  # noqa: E402
from tokenhaul.models.catalog import resolve  # noqa: E402

ROWS = [  # (label, summary path, format)
    ("completed", ("completed",), ".0f"),
    ("mean in flight", ("mean_in_flight",), ".1f"),
    ("output tok/s", ("output_throughput",), ".1f"),
    ("total tok/s", ("total_token_throughput",), ".1f"),
    ("goodput req/s", ("goodput",), ".3f"),
    ("TTFT p50 ms", ("ttft_ms", "p50"), ".0f"),
    ("TTFT p90 ms", ("ttft_ms", "p90"), ".0f"),
    ("TTFT p99 ms", ("ttft_ms", "p99"), ".0f"),
    ("ITL p50 ms", ("itl_ms", "p50"), ".1f"),
    ("ITL p90 ms", ("itl_ms", "p90"), ".1f"),
    ("ITL p99 ms", ("itl_ms", "p99"), ".1f"),
    ("ITL max ms", ("itl_ms", "max"), ".0f"),
    ("ITL p99/p50", ("itl_p99_over_p50",), ".2f"),
    ("E2E p50 ms", ("e2e_ms", "p50"), ".0f"),
]


def _get(s: dict, path: tuple[str, ...]) -> float | None:
    v = s
    for k in path:
        v = v.get(k) if isinstance(v, dict) else None
    return v


def run_workload(url: str, args: argparse.Namespace) -> dict:
    specs = loadgen.mixed_dataset(args.num_requests, args.short_len, args.long_len, args.long_fraction,
                                  args.output_len, args.seed)
    s = loadgen.benchmark(url, specs, args.slo_ttft_ms, slo_itl_ms=args.slo_itl_ms, concurrency=args.concurrency,
                          rate=args.rate, seed=args.seed, temperature=0.0, ignore_eos=True, warmup=2)
    print(f"  {s['completed']}/{s['requests']} ok, {s['output_throughput']:.1f} tok/s, ITL p50 "
          f"{s['itl_ms']['p50']:.1f} p99 {s['itl_ms']['p99']:.1f} ms, TTFT p50 {s['ttft_ms']['p50']:.0f} ms",
          flush=True)
    return s


def table(results: dict[str, dict], base: str = "budget off") -> str:
    names = list(results)
    lines = [f"{'':<16}" + "".join(f"{n:>16}" for n in names)
             + "".join(f"{n + ' / off':>16}" for n in names if n.startswith("budget") and n != base)]
    for label, path, fmt in ROWS:
        vals = [_get(results[n], path) for n in names]
        row = f"{label:<16}" + "".join(f"{'-' if v is None else format(v, fmt):>16}" for v in vals)
        b = _get(results[base], path) if base in results else None
        for n, v in zip(names, vals):
            if n.startswith("budget") and n != base:
                row += f"{(v / b) if v is not None and b else math.nan:>16.2f}"
        lines.append(row)
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--num-requests", type=int, default=48)
    ap.add_argument("--concurrency", type=int, default=24, help="at most N streams in flight")
    ap.add_argument("--rate", type=float, default=4.0, help="Poisson arrivals per second")
    ap.add_argument("--short-len", type=int, default=48, help="short prompts, words (± 20 %%)")
    ap.add_argument("--long-len", type=int, default=384, help="long prompts, words (± 20 %%)")
    ap.add_argument("--long-fraction", type=float, default=0.25)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--targets", default="default",
                    help="comma-separated --itl-target-ms values for the budget-on runs ('default': 200)")
    ap.add_argument("--slo-ttft-ms", type=float, default=2000.0)
    ap.add_argument("--slo-itl-ms", type=float, default=150.0)
    ap.add_argument("--no-llamacpp", action="store_true")
    ap.add_argument("--llamacpp-poll", type=int, default=0, help="ggml busy-wait 0-100; 0 sleeps (shared CPU)")
    ap.add_argument("--json", default=None, metavar="PATH")
    args = ap.parse_args()
    ctx = int(args.long_len * 1.2 * 1.5) + args.output_len + 64  # words → tokens, with room
    print(f"{args.model} threads={args.threads} requests={args.num_requests} concurrency≤{args.concurrency} "
          f"rate={args.rate:g}/s prompts {args.short_len}/{args.long_len} words ({args.long_fraction:.0%} long) "
          f"output={args.output_len} SLO TTFT≤{args.slo_ttft_ms:g} ms, longest gap≤{args.slo_itl_ms:g} ms",
          flush=True)
    runs = [("budget off", ("--itl-target-ms", "0"))]
    for t in args.targets.split(","):
        runs.append(("budget on", ("--itl-target-ms", "200")) if t == "default" else
                    (f"budget {t} ms", ("--itl-target-ms", t)))
    results: dict[str, dict] = {}
    for name, extra in runs:
        print(f"tokenhaul serve, {name} ...", flush=True)
        with tokenhaul_server(args.model, args.threads, args.concurrency, ctx, extra) as url:
            results[name] = run_workload(url, args)
    if not args.no_llamacpp:
        print("llama.cpp server ...", flush=True)
        with LlamaCppServer(resolve(args.model).gguf_path, threads=args.threads, n_parallel=args.concurrency,
                            ctx_size=ctx, poll=args.llamacpp_poll, verbosity=0) as srv:
            results["llama.cpp"] = run_workload(srv.root_url, args)
    print()
    print(table(results))
    if args.json:
        Path(args.json).write_text(json.dumps({"args": vars(args), "results": results}, indent=2, default=str))


if __name__ == "__main__":
    main()
