"""Single-stream speed, side by side in one run: tokenhaul vs transformers (and llama.cpp as the bar).

Same GGUF, same thread count, greedy, EOS ignored. Prints prefill and decode tokens/s, achieved
GB/s of tokenhaul's decode (bytes from the ledger), and ratios against each peer.

    .venv/bin/python bench/generate.py --model smollm2-135m --threads 2
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402
from peers import hf_speed, llamacpp_speed, synthetic_prompt  # noqa: E402

from tokenhaul import LLM, SamplingParams  # noqa: E402


def tokenhaul_speed(llm: LLM, prompt: list[int], new_tokens: int) -> dict:
    params = SamplingParams(max_tokens=new_tokens, temperature=0, ignore_eos=True)
    llm.generate(prompt[:16], SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))  # warm up
    best = None
    for _ in range(2):
        s = llm.generate(prompt, params)[0].ledger.summary()
        if best is None or s["decode_tokens_per_s"] > best["decode_tokens_per_s"]:
            best = s
    return {"engine": f"tokenhaul ({llm.config.dtype})", **best}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--prompt-tokens", type=int, default=128)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--dtypes", default="fp32,bf16")
    ap.add_argument("--no-llamacpp", action="store_true")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    prompt = synthetic_prompt(args.prompt_tokens)
    rows = []
    gguf = None
    for dtype in args.dtypes.split(","):
        llm = LLM(args.model, dtype=dtype, threads=args.threads, enable_prefix_caching=False)
        gguf = llm.files.gguf_path
        rows.append(tokenhaul_speed(llm, prompt, args.new_tokens))
        del llm
    rows.append(hf_speed(gguf, prompt, args.new_tokens, args.threads))
    if not args.no_llamacpp:
        rows.append(llamacpp_speed(gguf, prompt, args.new_tokens, args.threads))
    ours = rows[0]
    print(f"\nmodel {args.model} | threads {args.threads} | prompt {args.prompt_tokens} | new {args.new_tokens}")
    print(f"{'engine':<22}{'prefill tok/s':>15}{'decode tok/s':>14}{'decode GB/s':>13}"
          f"{'prefill ×':>11}{'decode ×':>10}")
    for r in rows:
        gbs = r.get("decode_gb_per_s")
        print(f"{r['engine']:<22}{r['prefill_tokens_per_s']:>15.1f}{r['decode_tokens_per_s']:>14.1f}"
              f"{(f'{gbs:.1f}' if gbs else '-'):>13}"
              f"{ours['prefill_tokens_per_s'] / r['prefill_tokens_per_s']:>11.2f}"
              f"{ours['decode_tokens_per_s'] / r['decode_tokens_per_s']:>10.2f}")
    print("(× = first tokenhaul row ÷ that row; >1 means tokenhaul is faster)")


if __name__ == "__main__":
    main()
