"""bf16 KV decodes of eager (batched) steps: SDPA over a gathered copy of every sequence's blocks vs the C++ kernel
reading them in place (kv/decode_attention.py), in one process, arms alternated each round. B streams of about
`--context` prompt tokens each generate `--new-tokens` greedily; decode tok/s from the ledger's decode steps
(median of rounds), and how many greedy texts the two arms share.

The SDPA arm is what the engine ran before the kernel took bf16 decodes: `decode_attention.available` reads False
for it, as on a host without a C++ compiler.

    flock -x /tmp/tokenhaul-bench.lock .venv/bin/python bench/eager_decode_attention.py \\
        --batches 8,32 --contexts 1500,200
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from tokenhaul import LLM, SamplingParams  # noqa: E402, I001
from tokenhaul.kv import decode_attention  # noqa: E402
from peers import synthetic_prompt  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default="smollm2-135m,qwen2.5-coder-0.5b")
    ap.add_argument("--batches", default="8", help="streams per run, comma list (paired with --contexts)")
    ap.add_argument("--contexts", default="1500", help="prompt tokens per stream, comma list")
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    if not decode_attention.available():
        sys.exit("the decode kernel did not build here: nothing to compare")
    kernel = decode_attention.available
    arms = {"sdpa": lambda: False, "kernel": kernel}
    sp = SamplingParams(max_tokens=args.new_tokens, temperature=0, ignore_eos=True)
    print("| model | streams × context | SDPA tok/s (rounds) | kernel tok/s (rounds) | kernel ÷ SDPA | same text |")
    print("|---|---|---|---|---|---|")
    for model in args.models.split(","):
        llm = LLM(model, compile="off", dtype="bf16")  # every decode step eager, as batched steps run
        for B, ctx in zip(map(int, args.batches.split(",")), map(int, args.contexts.split(","))):
            prompts = [synthetic_prompt(ctx, seed=i) for i in range(B)]
            llm.generate(prompts, sp)  # warm-up
            rates: dict[str, list[float]] = {arm: [] for arm in arms}
            texts: dict[str, list[str]] = {}
            for r in range(args.rounds):
                for arm in (list(arms) if r % 2 == 0 else list(arms)[::-1]):
                    decode_attention.available = arms[arm]
                    outs = llm.generate(prompts, sp)
                    steps = [s for s in outs[0].ledger.steps if not s.is_prefill]
                    rates[arm].append(sum(s.num_sampled for s in steps) / sum(s.seconds for s in steps))
                    texts[arm] = [o.text for o in outs]
            decode_attention.available = kernel
            med = {arm: statistics.median(v) for arm, v in rates.items()}
            same = sum(a == b for a, b in zip(texts["sdpa"], texts["kernel"]))
            cells = [f"{med[a]:.1f} ({' '.join(f'{x:.0f}' for x in rates[a])})" for a in arms]
            print(f"| {model} | {B} × {ctx} | {cells[0]} | {cells[1]} | {med['kernel'] / med['sdpa']:.2f}× | "
                  f"{same} of {B} |", flush=True)
        del llm


if __name__ == "__main__":
    main()
