"""What --deterministic costs: prefill 512 tokens and greedy decode at batch 1 and 8 on SmolLM2-135M
(default dtype and quantization), default vs deterministic, side by side in one process; prints ratios.

    python bench/determinism.py [--model smollm2-135m] [--repeats 3]
"""

from __future__ import annotations

import argparse
import statistics
import time

from tokenhaul import LLM, SamplingParams


def timed(llm: LLM, prompts: list[list[int]], max_tokens: int) -> float:
    t = time.perf_counter()
    llm.generate(prompts, SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True))
    return time.perf_counter() - t


def measure(llm: LLM, repeats: int) -> dict[str, float]:
    vocab = llm.model.config.vocab_size
    out: dict[str, list[float]] = {"prefill 512 (tok/s)": [], "decode b=1 (tok/s)": [], "decode b=8 (tok/s)": []}
    for r in range(repeats):
        long = [[(r * 7919 + i * 31) % (vocab - 10) + 5 for i in range(512)]]  # fresh: no prefix-cache hit
        out["prefill 512 (tok/s)"].append(512 / timed(llm, long, 1))
        for b in (1, 8):
            prompts = [[(r * 101 + j * 13 + i) % (vocab - 10) + 5 for i in range(16)] for j in range(b)]
            first = timed(llm, prompts, 1)
            out[f"decode b={b} (tok/s)"].append(b * 32 / max(timed(llm, prompts, 33) - first, 1e-9))
    return {k: statistics.median(v) for k, v in out.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    llms = {"default": LLM(args.model), "deterministic": LLM(args.model, deterministic=True)}
    for llm in llms.values():
        timed(llm, [[5, 6, 7, 8]], 4)  # warm up
    rows = {name: measure(llm, args.repeats) for name, llm in llms.items()}
    print(f"{args.model}: --deterministic vs default (median of {args.repeats}, one process)")
    print("| metric | default | deterministic | ratio |\n|---|---|---|---|")
    for k in rows["default"]:
        d, x = rows["default"][k], rows["deterministic"][k]
        print(f"| {k} | {d:.1f} | {x:.1f} | {x / d:.2f} |")


if __name__ == "__main__":
    main()
