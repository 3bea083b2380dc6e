"""Serving, side by side: the same load (tokenhaul's load generator, streamed /v1/completions) against
`tokenhaul serve` and against llama.cpp's server (xllamacpp), on the same GGUF with the same threads.
Greedy, EOS ignored (every request generates exactly --output-len tokens), one server at a time.

    .venv/bin/python bench/serve_vs_llamacpp.py --model smollm2-135m --concurrency 1,8 --num-requests 24

Ratios are tokenhaul / llama.cpp: above 1 is better for throughput rows, below 1 for latency rows.
The load generator shares the CPU with the server under test (as it would with any local client).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import socket
import subprocess
import sys
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))
sys.path.insert(0, str(ROOT))

from peers import LlamaCppServer  # noqa: E402

from tokenhaul.bench import loadgen  # noqa: E402
from tokenhaul.models.catalog import resolve  # noqa: E402

ROWS = [  # (label, summary path, higher is better)
    ("output tok/s", ("output_throughput",), True),
    ("requests/s", ("request_throughput",), True),
    ("goodput req/s", ("goodput",), True),
    ("TTFT p50 ms", ("ttft_ms", "p50"), False),
    ("TTFT p99 ms", ("ttft_ms", "p99"), False),
    ("TPOT p50 ms", ("tpot_ms", "p50"), False),
    ("TPOT p99 ms", ("tpot_ms", "p99"), False),
    ("ITL p50 ms", ("itl_ms", "p50"), False),
    ("ITL p99 ms", ("itl_ms", "p99"), False),
    ("E2E p50 ms", ("e2e_ms", "p50"), False),
    ("E2E p99 ms", ("e2e_ms", "p99"), False),
]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextmanager
def tokenhaul_server(model: str, threads: int, max_num_seqs: int, ctx: int, extra: tuple[str, ...] = ()):
    """`tokenhaul serve` in a child process (its own threads and memory, like llama.cpp's); extra: more flags."""
    port = _free_port()
    log = tempfile.NamedTemporaryFile("w+", prefix="tokenhaul-serve-", suffix=".log", delete=False)
    cmd = [sys.executable, "-m", "tokenhaul.cli", "serve", "--model", model, "--threads", str(threads),
           "--port", str(port), "--max-num-seqs", str(max_num_seqs), "--max-model-len", str(ctx),
           "--log-level", "warning", "--max-waiting", "100000", *extra]
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=log, stderr=log, env=os.environ | {"PYTHONUNBUFFERED": "1"})
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 300
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"tokenhaul serve exited:\n{Path(log.name).read_text()[-2000:]}")
            try:
                if httpx.get(url + "/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise TimeoutError("tokenhaul serve did not start")
            time.sleep(0.2)
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        log.close()
        Path(log.name).unlink(missing_ok=True)


def run_levels(url: str, levels: list[int], args: argparse.Namespace) -> dict[int, dict]:
    out = {}
    for n in levels:
        specs = loadgen.random_dataset(args.num_requests, args.input_len, args.output_len, seed=args.seed)
        s = loadgen.benchmark(url, specs, args.slo_ttft_ms, args.slo_tpot_ms, concurrency=n, rate=args.rate,
                              seed=args.seed, temperature=0.0, ignore_eos=True, warmup=2)
        print(f"  concurrency {n}: {s['completed']}/{s['requests']} ok, {s['output_throughput']:.1f} tok/s", flush=True)
        out[n] = s
    return out


def _get(s: dict, path: tuple[str, ...]) -> float | None:
    v = s
    for k in path:
        v = v.get(k) if isinstance(v, dict) else None
    return v


def table(results: dict[str, dict[int, dict]], levels: list[int]) -> str:
    lines = [f"{'':<16}{'tokenhaul':>12}{'llama.cpp':>12}{'ratio':>8}"]
    for n in levels:
        th, lc = results["tokenhaul"][n], results["llama.cpp"][n]
        lines.append(f"concurrency {n}  ({th['completed']}+{lc['completed']} requests completed)")
        for label, path, higher in ROWS:
            a, b = _get(th, path), _get(lc, path)
            if a is None and b is None:
                continue
            ratio = a / b if a is not None and b else math.nan
            mark = "↑" if higher else "↓"
            fa, fb = ("-" if x is None else f"{x:.1f}" for x in (a, b))
            lines.append(f"  {label:<14}{fa:>12}{fb:>12}{ratio:>8.2f} {mark}")
        lm = th.get("last_mile_us_per_token")
        if lm:
            lines.append(f"  tokenhaul last mile {lm['total']:.1f} µs/token "
                         f"(detokenize+stop {lm['detokenize']:.1f}, SSE framing {lm['frame']:.1f})")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--concurrency", default="1,8")
    ap.add_argument("--rate", type=float, default=math.inf, help="Poisson arrivals per second (default inf)")
    ap.add_argument("--num-requests", type=int, default=24)
    ap.add_argument("--input-len", type=int, default=64)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--slo-ttft-ms", type=float, default=1000.0)
    ap.add_argument("--slo-tpot-ms", type=float, default=100.0)
    ap.add_argument("--llamacpp-poll", type=int, default=None,
                    help="ggml busy-wait 0-100 (default llama.cpp's 50); 0 sleeps, kinder to a shared CPU")
    ap.add_argument("--json", default=None, metavar="PATH")
    args = ap.parse_args()
    levels = [int(x) for x in args.concurrency.split(",")]
    gguf = resolve(args.model).gguf_path
    ctx = 2 * (args.input_len + args.output_len) + 64
    results: dict[str, dict[int, dict]] = {}
    print(f"{args.model}  threads={args.threads}  requests={args.num_requests}  input≈{args.input_len} words  "
          f"output={args.output_len} tokens  rate={args.rate:g}/s", flush=True)
    print("tokenhaul serve ...", flush=True)
    with tokenhaul_server(args.model, args.threads, max(levels), ctx) as url:
        results["tokenhaul"] = run_levels(url, levels, args)
    print("llama.cpp server ...", flush=True)
    with LlamaCppServer(gguf, threads=args.threads, n_parallel=max(levels), ctx_size=ctx, poll=args.llamacpp_poll,
                        verbosity=0) as srv:
        results["llama.cpp"] = run_levels(srv.root_url, levels, args)
    print()
    print(table(results, levels))
    if args.json:
        Path(args.json).write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items()},
                                               "results": results}, indent=2, default=str))


if __name__ == "__main__":
    main()
