"""Decode speed at batch 1: the engine's paged KV (block tables + gather) vs a contiguous cache.

The contiguous variant swaps the attention function for one that reads K/V as a plain slice of the
cache (valid here: one sequence whose blocks are 0, 1, 2, … in order). Same model, same process,
interleaved runs; the target is paged ≥ 0.85 × contiguous.

    .venv/bin/python bench/paged_vs_contiguous.py --model smollm2-135m --context 512
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F

import tokenhaul.models.gemma3 as gemma3_mod
import tokenhaul.models.llama as llama_mod
from tokenhaul import LLM, SamplingParams
from tokenhaul.config import EngineConfig
from tokenhaul.engine.core import EngineCore
from tokenhaul.layers.attention import paged_attention


def contiguous_attention(q, k, v, k_cache, v_cache, meta, scale, sliding):
    """Single sequence, slots == positions: K/V are k_cache[:L] with no gather."""
    pos = meta.positions
    T, H, D = q.shape
    kc, vc = k_cache.view(-1, k.shape[1], D), v_cache.view(-1, k.shape[1], D)
    kc[pos] = k.to(kc.dtype)
    vc[pos] = v.to(vc.dtype)
    L = int(pos[-1]) + 1
    qg = q.view(1, T, H, D).transpose(1, 2)
    kg = kc[:L].unsqueeze(0).transpose(1, 2).to(q.dtype)
    vg = vc[:L].unsqueeze(0).transpose(1, 2).to(q.dtype)
    o = F.scaled_dot_product_attention(qg, kg, vg, is_causal=T > 1, scale=scale, enable_gqa=True)
    return o.transpose(1, 2).reshape(T, H * D)


def decode_rate(llm: LLM, prompt: list[int], new_tokens: int, attention) -> float:
    llama_mod.paged_attention = gemma3_mod.paged_attention = attention
    try:
        core = EngineCore(EngineConfig(dtype=llm.config.dtype, num_kv_blocks=(len(prompt) + new_tokens) // 16 + 2,
                                       enable_prefix_caching=False), llm.model)
        core.add_request("r", prompt, SamplingParams(max_tokens=new_tokens, temperature=0, ignore_eos=True))
        while not core.step():  # prefill, in chunks, until the first token is sampled
            pass
        t0 = time.perf_counter()
        steps = 0
        while core.has_unfinished():
            core.step()
            steps += 1
        return steps / (time.perf_counter() - t0)
    finally:
        llama_mod.paged_attention = gemma3_mod.paged_attention = paged_attention


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--contexts", default="128,512,2048")
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--dtype", default="bf16")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    llm = LLM(args.model, threads=args.threads, dtype=args.dtype)
    print(f"model {args.model} {args.dtype} | threads {args.threads} | batch 1 | {args.new_tokens} decode steps, "
          f"median of {args.rounds} interleaved rounds")
    print(f"{'context':>8}{'paged tok/s':>13}{'contig tok/s':>14}{'paged/contig':>14}")
    for ctx in map(int, args.contexts.split(",")):
        prompt = [1000 + (i * 37) % 20000 for i in range(ctx)]
        paged, contig = [], []
        for _ in range(args.rounds):
            paged.append(decode_rate(llm, prompt, args.new_tokens, paged_attention))
            contig.append(decode_rate(llm, prompt, args.new_tokens, contiguous_attention))
        p, c = statistics.median(paged), statistics.median(contig)
        print(f"{ctx:>8}{p:>13.1f}{c:>14.1f}{p / c:>14.2f}")


if __name__ == "__main__":
    main()
