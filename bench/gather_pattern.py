"""How fast can this machine read the rows a gathered GEMV keeps? The read pattern alone, no arithmetic, from DRAM.

The gathered (sparse) GEMV of layers/sparse_gemv.cpp reads, per thread, the kept input rows of its column parts
([P, K, w] bytes) in ascending order, four rows a pass, 64-byte blocks interleaved, the rows a few ahead
prefetched. This times exactly that pattern over 512 MB of parts (≫ L3) with no arithmetic, for kept sets drawn
at random (what TEAL's magnitude threshold gives: the kept channels of real activations are not clustered, see
`--model`) and for the same share kept as one contiguous run, and prints the useful bytes per second. Time per
useful byte at a random 60 % kept against every row kept bounds what a gathered kernel can gain at sparsity 0.4:
  gain ≤ (GB/s at 60 % random) / (0.6 · GB/s at 100 %).

`--model M` also runs M (int8, sparsity 0.4, eager) on a few prompts, records which inputs each sparse linear kept
at batch-1 decode, and prints how clustered they are: runs of consecutive kept channels per kept channel (random
at share f: about 1 - f), in the stored order and with channels sorted by how often the first half of the tokens
kept them (a permutation at load would cluster them only if that drops well below 1 - f).

    flock -x /tmp/tokenhaul-bench.lock .venv/bin/python bench/gather_pattern.py [--model smollm2-135m]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from torch.utils.cpp_extension import load_inline

CPP = r"""
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>
#include <algorithm>

// XOR of every kept row's bytes over all parts: rows idx (ascending) of each part [K, w], four a pass, 64-byte
// blocks of the four interleaved, the rows `ahead` kept rows on prefetched (0: none)
int64_t read_rows(const at::Tensor& parts, const at::Tensor& idx, int64_t ahead) {
  const int64_t P = parts.size(0), K = parts.size(1), w = parts.size(2), n = idx.numel() / 4 * 4;
  const uint8_t* base = parts.data_ptr<uint8_t>();
  const int32_t* ix = idx.data_ptr<int32_t>();
  std::vector<int64_t> out(P, 0);
  at::parallel_for(0, P, 1, [&](int64_t p0, int64_t p1) {
    for (int64_t p = p0; p < p1; ++p) {
      const uint8_t* part = base + p * K * w;
      __m256i acc = _mm256_setzero_si256();
      for (int64_t j = 0; j < n; j += 4) {
        if (ahead)
          for (int64_t a = j + ahead; a < std::min(n, j + ahead + 4); ++a)
            for (int64_t b = 0; b < w; b += 64)
              _mm_prefetch(reinterpret_cast<const char*>(part + ix[a] * w + b), _MM_HINT_T1);
        for (int64_t c = 0; c + 32 <= w; c += 32)
          for (int q = 0; q < 4; ++q)
            acc = _mm256_xor_si256(acc, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(part + ix[j + q] * w + c)));
      }
      alignas(32) int64_t lanes[4];
      _mm256_store_si256(reinterpret_cast<__m256i*>(lanes), acc);
      out[p] = lanes[0] ^ lanes[1] ^ lanes[2] ^ lanes[3];
    }
  });
  int64_t x = 0;
  for (int64_t v : out) x ^= v;
  return x;
}
"""


def kept_sets(k: int, seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    sets = {"every row": torch.arange(k)}
    for share in (0.6, 0.3):
        sets[f"{share:.0%} random"] = torch.nonzero(torch.rand(k, generator=g) < share).flatten()
        sets[f"{share:.0%} one run"] = torch.arange(int(share * k))
    return {name: s.to(torch.int32).contiguous() for name, s in sets.items()}


def pattern_table(widths: list[int], k: int, ahead: int, repeats: int) -> None:
    op = load_inline("tokenhaul_gather_pattern", CPP, functions=["read_rows"],
                     extra_cflags=["-O3", "-mavx2", "-fopenmp"], extra_ldflags=["-fopenmp"])
    flush = torch.zeros(1 << 27)  # 512 MB written between passes
    print(f"threads {torch.get_num_threads()}, K = {k} rows per part, prefetch {ahead} rows ahead, best of {repeats}")
    print("| part width (bytes) | kept | useful GB/s | time per useful byte vs every row |\n|---|---|---|---|")
    for w in widths:
        parts = torch.ones(max(2, (512 << 20) // (k * w)), k, w, dtype=torch.uint8)
        full = None
        for name, idx in kept_sets(k).items():
            n = idx.numel() // 4 * 4
            best = float("inf")
            for _ in range(repeats):
                flush.add_(1)
                t = time.perf_counter()
                op.read_rows(parts, idx, ahead)
                best = min(best, time.perf_counter() - t)
            rate = parts.shape[0] * n * w / best
            full = full or rate
            print(f"| {w} | {name} | {rate / 1e9:.1f} | {full / rate:.2f} |", flush=True)


def clustering(model: str) -> None:
    from tokenhaul import LLM, SamplingParams
    from tokenhaul.layers.linear_sparse import SparseLinear

    llm = LLM(model, quantization="int8", sparsity=0.4, compile="off")
    masks: dict[int, tuple[SparseLinear, list[torch.Tensor]]] = {}
    call = SparseLinear.__call__

    def record(self: SparseLinear, x: torch.Tensor) -> torch.Tensor:
        if x.shape[0] == 1:
            masks.setdefault(id(self), (self, []))[1].append(x.float().abs()[0] >= self.threshold)
        return call(self, x)

    SparseLinear.__call__ = record
    try:
        for p in ("def quicksort(arr):\n    ", "The history of the city begins with a small settlement on the river,",
                  "Explain how a language model decodes one token at a time.", "Write a haiku about bandwidth."):
            llm.generate([p], SamplingParams(max_tokens=48, temperature=0, ignore_eos=True))
    finally:
        SparseLinear.__call__ = call

    def runs(m: torch.Tensor) -> float:
        starts = (m[:, 1:] & ~m[:, :-1]).sum(1) + m[:, 0]
        return (starts.float() / m.sum(1).clamp_min(1)).mean().item()

    shapes: dict[tuple[int, int], list[tuple[float, float, float]]] = {}
    for lin, ms in masks.values():
        m = torch.stack(ms)
        first, second = m[: len(ms) // 2], m[len(ms) // 2:]
        order = torch.argsort(first.float().mean(0), descending=True, stable=True)
        shapes.setdefault((lin.in_features, lin.out_features), []).append(
            (second.float().mean().item(), runs(second), runs(second[:, order])))
    print(f"\n{model}, int8, sparsity 0.4, {len(next(iter(masks.values()))[1])} decode tokens per linear")
    print("| in × out | linears | kept | runs per kept channel, stored order | sorted by first-half keep rate |")
    print("|---|---|---|---|---|")
    for (i, o), v in shapes.items():
        print(f"| {i} × {o} | {len(v)} | {statistics.mean(x[0] for x in v):.2f} | "
              f"{statistics.mean(x[1] for x in v):.2f} | {statistics.mean(x[2] for x in v):.2f} |")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--widths", default="448,960,2048", help="part widths in bytes (int8 columns)")
    ap.add_argument("--rows", type=int, default=896, help="input rows per part (K)")
    ap.add_argument("--ahead", type=int, default=8)
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--model", default=None, help="also measure how clustered a real model's kept inputs are")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    pattern_table([int(w) for w in args.widths.split(",")], args.rows, args.ahead, args.repeats)
    if args.model:
        clustering(args.model)


if __name__ == "__main__":
    main()
