"""`bench serve`: the load generator (tokenhaul.bench.loadgen) against any OpenAI-compatible server."""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

from tokenhaul.errors import TokenhaulError


def add_parsers(sub: argparse._SubParsersAction) -> None:
    b = sub.add_parser("bench", help="benchmarks: `bench serve` (load generator for OpenAI-compatible servers)")
    bsub = b.add_subparsers(dest="bench_command", required=True)
    bs = bsub.add_parser("serve", help="Poisson / closed-loop load against a server: TTFT, TPOT, ITL, E2E, goodput")
    add_serve_args(bs)
    bs.set_defaults(func=cmd_bench_serve)


def add_serve_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--url", default="http://127.0.0.1:8000", help="server root (with or without /v1)")
    p.add_argument("--model", default=None, help="model name to send (default: the server's first)")
    p.add_argument("--concurrency", type=int, default=None, help="at most N requests in flight")
    p.add_argument("--rate", type=float, default=math.inf, help="Poisson arrival rate, requests/s (default inf)")
    p.add_argument("--num-requests", type=int, default=100)
    p.add_argument("--dataset", default="random",
                   help="'random', 'mixed' (long and short prompts), or a .jsonl / .txt file of prompts")
    p.add_argument("--input-len", type=int, default=64, help="random dataset: prompt length; mixed: short ones (words)")
    p.add_argument("--long-len", type=int, default=1024, help="mixed dataset: long prompt length, words")
    p.add_argument("--long-fraction", type=float, default=0.25, help="mixed dataset: share of long prompts")
    p.add_argument("--output-len", type=int, default=64, help="max_tokens per request")
    p.add_argument("--range-ratio", type=float, default=0.0, help="random dataset: lengths vary by ±ratio")
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--no-ignore-eos", action="store_false", dest="ignore_eos",
                   help="let requests stop at EOS (default: exactly max_tokens tokens)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--warmup", type=int, default=1, help="requests sent (and not counted) first")
    p.add_argument("--slo-ttft-ms", type=float, default=None)
    p.add_argument("--slo-tpot-ms", type=float, default=None)
    p.add_argument("--slo-itl-ms", type=float, default=None, help="bound on a request's longest inter-token gap")
    p.add_argument("--slo-e2e-ms", type=float, default=None)
    p.add_argument("--json", default=None, metavar="PATH", help="also write the summary as JSON ('-' = stdout)")


def check_serve_args(args: argparse.Namespace) -> None:
    """Refuse arguments no run can use before any connection (else they surface as 'cannot reach' or a hang)."""
    if args.num_requests < 1:
        raise TokenhaulError(f"--num-requests must be at least 1, got {args.num_requests}")
    if not args.rate > 0:  # NaN too
        raise TokenhaulError(f"--rate must be > 0 requests/s (default inf), got {args.rate:g}")
    if args.concurrency is not None and args.concurrency < 1:
        raise TokenhaulError(f"--concurrency must be at least 1, got {args.concurrency}")
    if args.warmup < 0:
        raise TokenhaulError(f"--warmup must be at least 0, got {args.warmup}")


def cmd_bench_serve(args: argparse.Namespace) -> None:
    from tokenhaul.bench.loadgen import base_url, benchmark, file_dataset, format_table, mixed_dataset, random_dataset

    check_serve_args(args)
    if args.concurrency is None and not math.isfinite(args.rate):
        print("note: neither --concurrency nor --rate given: all requests are sent at once", file=sys.stderr)
    if args.dataset == "random":
        specs = random_dataset(args.num_requests, args.input_len, args.output_len, args.range_ratio, args.seed)
    elif args.dataset == "mixed":
        specs = mixed_dataset(args.num_requests, args.input_len, args.long_len, args.long_fraction, args.output_len,
                              args.seed)
    else:
        specs = file_dataset(args.dataset, args.num_requests, args.output_len)
    s = benchmark(args.url, specs, args.slo_ttft_ms, args.slo_tpot_ms, args.slo_e2e_ms, args.slo_itl_ms,
                  model=args.model, concurrency=args.concurrency, rate=args.rate, seed=args.seed,
                  temperature=args.temperature, ignore_eos=args.ignore_eos, warmup=args.warmup)
    s["config"] = {k: v if not (isinstance(v, float) and math.isinf(v)) else "inf" for k, v in vars(args).items()
                   if k not in ("func",)}
    head = (f"bench serve {base_url(args.url)} model={s['model']} requests={args.num_requests} "
            f"concurrency={args.concurrency or '∞'} rate={args.rate:g}/s dataset={args.dataset}")
    if args.json != "-":
        print(head)
        print(format_table(s))
    if args.json:
        text = json.dumps(s, indent=2, default=str)
        if args.json == "-":
            print(text)
        else:
            Path(args.json).write_text(text)
    if not s["completed"]:  # nothing measured: a failed run, not a table of zeros
        raise TokenhaulError(f"all {s['failed']} requests failed: {'; '.join(s['errors']) or 'no error given'}")
