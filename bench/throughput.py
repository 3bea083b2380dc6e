"""Offline throughput (generated tokens/s) at several concurrencies, side by side in one run:
tokenhaul (continuous batching) vs transformers (batched generate) vs llama.cpp server (n_parallel
slots, via xllamacpp). Same GGUF, same threads, greedy, EOS ignored, one wave of N requests.

    .venv/bin/python bench/throughput.py --models smollm2-135m,qwen2.5-coder-0.5b --concurrency 1,8,32,64
"""

from __future__ import annotations

import argparse
import gc
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402
from peers import _HF_MODELS, hf_throughput, llamacpp_throughput, synthetic_prompt  # noqa: E402

from tokenhaul import LLM, SamplingParams  # noqa: E402


def tokenhaul_throughput(llm: LLM, prompts: list[list[int]], new_tokens: int) -> float:
    params = SamplingParams(max_tokens=new_tokens, temperature=0, ignore_eos=True)
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params)
    wall = time.perf_counter() - t0
    return sum(len(o.token_ids) for o in outs) / wall


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--models", default="smollm2-135m,qwen2.5-coder-0.5b")
    ap.add_argument("--concurrency", default="1,8,32,64")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--prompt-tokens", type=int, default=64)
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--no-hf", action="store_true")
    ap.add_argument("--no-llamacpp", action="store_true")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    table = []
    for model in args.models.split(","):
        llm = LLM(model, threads=args.threads, max_num_seqs=64, max_num_batched_tokens=2048,
                  enable_prefix_caching=False)
        gguf = llm.files.gguf_path
        llm.generate(synthetic_prompt(8), SamplingParams(max_tokens=2, ignore_eos=True))  # warm up
        for n in map(int, args.concurrency.split(",")):
            prompts = [synthetic_prompt(args.prompt_tokens, seed=i) for i in range(n)]
            row = {"model": model, "n": n, "tokenhaul": tokenhaul_throughput(llm, prompts, args.new_tokens)}
            if not args.no_hf:
                row["transformers"] = hf_throughput(gguf, prompts, args.new_tokens, n, args.threads)["tokens_per_s"]
            if not args.no_llamacpp:
                row["llama.cpp"] = llamacpp_throughput(gguf, prompts, args.new_tokens, n, args.threads)["tokens_per_s"]
            table.append(row)
            print(row, flush=True)
        del llm
        _HF_MODELS.clear()
        gc.collect()
    peers = [p for p in ("transformers", "llama.cpp") if p in table[0]]
    print(f"\nthreads {args.threads} | prompt {args.prompt_tokens} | new {args.new_tokens} | generated tokens/s")
    head = f"{'model':<20}{'N':>4}{'tokenhaul':>11}" + "".join(f"{p:>14}{'ratio':>7}" for p in peers)
    print(head)
    for r in table:
        line = f"{r['model']:<20}{r['n']:>4}{r['tokenhaul']:>11.1f}"
        for p in peers:
            line += f"{r[p]:>14.1f}{r['tokenhaul'] / r[p]:>7.2f}"
        print(line)
    print("(ratio = tokenhaul ÷ peer; >1 means tokenhaul is faster)")


if __name__ == "__main__":
    main()
