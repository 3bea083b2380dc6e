"""TTFT with and without a prefix-cache hit: two requests sharing a ~1,000-token prefix; then `--together` requests
sharing it that arrive at once (n samples, a common system prompt): the time until each has its first token, when
the later ones wait for the first's shared blocks (the scheduler's default) against computing them side by side.

    flock -x /tmp/tokenhaul-bench.lock .venv/bin/python bench/prefix_cache.py --model smollm2-135m
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from tokenhaul import LLM, SamplingParams
from tokenhaul.engine.scheduler import Scheduler


def ttft(llm: LLM, ids: list[int] | list[list[int]]) -> float:
    t0 = time.perf_counter()
    llm.generate(ids, SamplingParams(max_tokens=1, temperature=0))
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--prefix-tokens", type=int, default=1000)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--together", type=int, default=4, help="requests sharing the prefix sent at once")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    on = LLM(args.model, threads=args.threads, max_num_batched_tokens=2048)
    off = LLM(args.model, threads=args.threads, max_num_batched_tokens=2048, enable_prefix_caching=False)
    cold, warm = [], []
    for r in range(args.rounds):
        prefix = [1000 + (i * 31 + r * 7919) % 20000 for i in range(args.prefix_tokens)]
        a, b = prefix + [101, 102, 103], prefix + [201, 202, 203, 204]
        ttft(on, a)  # fills the cache with the shared prefix
        warm.append(ttft(on, b))
        cold.append(ttft(off, b))
    c, w = statistics.median(cold), statistics.median(warm)
    print(f"model {args.model} | threads {args.threads} | shared prefix {args.prefix_tokens} tokens")
    print(f"{'':<22}{'TTFT ms':>10}")
    print(f"{'no prefix cache':<22}{c * 1e3:>10.1f}")
    print(f"{'prefix cache hit':<22}{w * 1e3:>10.1f}")
    print(f"TTFT ratio (hit / cold): {w / c:.3f}   speed-up ×{c / w:.1f}")
    together(on, args)


def together(llm: LLM, args: argparse.Namespace) -> None:
    """`--together` prompts sharing a fresh prefix, sent in one call (max_tokens 1): seconds until the last first
    token, with the scheduler holding the later ones until the shared blocks are cached, and without (a patch)."""
    waits = Scheduler._prefix_in_flight
    times: dict[str, list[float]] = {"wait for the shared blocks": [], "compute side by side": []}
    for r in range(args.rounds):
        for name, patch in (("wait for the shared blocks", waits), ("compute side by side", lambda *a: False)):
            prefix = [1000 + (i * 37 + r * 104729 + len(name)) % 20000 for i in range(args.prefix_tokens)]
            ps = [prefix + [300 + k, 400 + k] for k in range(args.together)]
            Scheduler._prefix_in_flight = patch
            try:
                times[name].append(ttft(llm, ps))
            finally:
                Scheduler._prefix_in_flight = waits
    base = statistics.median(times["compute side by side"])
    print(f"\n{args.together} requests sharing the {args.prefix_tokens}-token prefix, sent together")
    print(f"{'':<28}{'last first token ms':>20}{'ratio':>8}")
    for name, ts in times.items():
        print(f"{name:<28}{statistics.median(ts) * 1e3:>20.1f}{statistics.median(ts) / base:>8.2f}")


if __name__ == "__main__":
    main()
