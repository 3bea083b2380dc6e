"""TTFT with and without a prefix-cache hit: two requests sharing a ~1,000-token prefix.

    .venv/bin/python bench/prefix_cache.py --model smollm2-135m
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from tokenhaul import LLM, SamplingParams


def ttft(llm: LLM, ids: list[int]) -> float:
    t0 = time.perf_counter()
    llm.generate(ids, SamplingParams(max_tokens=1, temperature=0))
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--prefix-tokens", type=int, default=1000)
    ap.add_argument("--rounds", type=int, default=3)
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


if __name__ == "__main__":
    main()
