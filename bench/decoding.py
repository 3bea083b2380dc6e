"""Decoding strategies side by side in one run: plain vs prompt lookup, Jacobi and a draft model.

For each task (input-grounded: rewrite a given function, summarise a given passage; free generation;
code written from a description) and each strategy: generated tokens/s end to end, decode tokens/s
(after the first token: the prompt's prefill, the draft's included, is TTFT), tokens per target pass
(generated ÷ target forward steps), drafts proposed / accepted, and the speed-up over plain decoding
of the same model in the same run (end to end, and decode only). SmolLM2 dense and packed for prompt
lookup and Jacobi, with a batch sweep showing where verification stops being free; the Qwen2.5-Coder
0.5B → 1.5B pair with the draft packed int4 (default), dense, and with a packed target. Greedy, EOS
honoured, batch 1 unless said.

    flock -x /tmp/tokenhaul-bench.lock .venv/bin/python bench/decoding.py
"""

from __future__ import annotations

import argparse
import time

import torch

from tokenhaul import LLM, SamplingParams

FUNCTION = '''def parse_config(path):
    result = {}
    with open(path) as f:
        for line in f:
            line = line.strip()
            if not line or line.startswith("#"):
                continue
            key, value = line.split("=", 1)
            key = key.strip()
            value = value.strip()
            if value.isdigit():
                value = int(value)
            elif value.lower() in ("true", "false"):
                value = value.lower() == "true"
            result[key] = value
    return result
'''
PASSAGE = ("The lighthouse at Cape Morrow was built in 1871 to guide ships past the reef that had sunk "
           "eleven vessels in twenty years. Its keeper, Elias Grant, lived in the cottage at its foot with "
           "his daughter Mary. Each night he climbed the ninety-six steps to light the lamp, trimmed the wick "
           "at midnight, and wrote the weather in the log. In the storm of 1884 the lamp failed, and Mary "
           "carried oil up the tower in the dark so that the light burned until dawn. The schooner Alba, "
           "caught on the reef's edge, saw the light and turned away in time. The log for that night is kept "
           "today in the town museum, beside Mary's lantern.")
TASKS = {
    "rewrite function": f"Rewrite this Python function with type hints and a docstring. Keep the logic.\n\n{FUNCTION}",
    "summarise passage": f"Summarise this passage in a few sentences, reusing its words.\n\n{PASSAGE}",
    "free generation": "Write a short story about a fox who learns to play the violin.",
    "write code": "Write a Python function that merges two sorted lists into one sorted list, with a docstring "
                  "and a few asserts that test it.",
}


def run(llm: LLM, prompt: str, spec: str, k: int, max_tokens: int, batch: int = 1) -> dict:
    params = SamplingParams(max_tokens=max_tokens, temperature=0, speculative=spec, num_speculative_tokens=k)
    ids = llm.encode(llm.tokenizer.apply_chat_template([{"role": "user", "content": prompt}]))
    t0 = time.perf_counter()
    outs = llm.generate([ids] * batch, params)
    wall = time.perf_counter() - t0
    led = outs[0].ledger
    s = led.summary()
    tokens = sum(len(o.token_ids) for o in outs)
    ttft = s["ttft_ms"]["max"] / 1e3
    return {"tokens": tokens, "tok_s": tokens / wall, "ttft": ttft, "dec_s": (tokens - batch) / (wall - ttft),
            "passes": led.num_steps,
            "per_pass": tokens / max(1, led.num_steps), "proposed": s["proposed_tokens"],
            "accepted": s["accepted_tokens"], "text": outs[0].token_ids}


def table(title: str, rows: list[tuple[str, str, dict]], base: dict[str, dict]) -> None:
    print(f"\n{title}")
    print(f"{'task':<19}{'strategy':<15}{'tokens':>7}{'tok/s':>8}{'TTFT s':>8}{'dec tok/s':>10}{'passes':>8}"
          f"{'tok/pass':>9}{'accept':>9}{'speed-up':>10}{'dec speed-up':>14}{'same text':>11}")
    for task, spec, r in rows:
        b = base[task]
        acc = f"{r['accepted']}/{r['proposed']}" if r["proposed"] else "-"
        print(f"{task:<19}{spec:<15}{r['tokens']:>7}{r['tok_s']:>8.2f}{r['ttft']:>8.2f}{r['dec_s']:>10.2f}"
              f"{r['passes']:>8}{r['per_pass']:>9.2f}{acc:>9}{r['tok_s'] / b['tok_s']:>9.2f}x"
              f"{r['dec_s'] / b['dec_s']:>13.2f}x{str(r['text'] == b['text']):>11}")


def strategies(llm: LLM, specs: list[str], k: int, max_tokens: int, tasks: list[str]) -> None:
    rows, base = [], {}
    for spec in ["off"] + specs:
        run(llm, TASKS[tasks[0]], spec, k, 4)  # warm up
    for task in tasks:
        for spec in ["off"] + specs:
            r = run(llm, TASKS[task], spec, k, max_tokens)
            if spec == "off":
                base[task] = r
            rows.append((task, spec, r))
    c = llm.config
    draft = f" + draft {c.draft_model} (quantization {c.draft_quant})" if c.draft_model else ""
    table(f"{llm.config.model}{draft} ({llm.config.dtype}, quantization {llm.config.quantization}), batch 1, "
          f"k={k}, max {max_tokens} tokens", rows, base)


def batch_sweep(llm: LLM, k: int, max_tokens: int, sizes: list[int]) -> None:
    print(f"\nbatch sweep: prompt lookup vs plain, {llm.config.model}, 'rewrite function', k={k}")
    print(f"{'batch':>6}{'plain tok/s':>13}{'lookup tok/s':>14}{'speed-up':>10}")
    for b in sizes:
        p = run(llm, TASKS["rewrite function"], "off", k, max_tokens, b)
        s = run(llm, TASKS["rewrite function"], "prompt_lookup", k, max_tokens, b)
        print(f"{b:>6}{p['tok_s']:>13.1f}{s['tok_s']:>14.1f}{s['tok_s'] / p['tok_s']:>9.2f}x")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--k", type=int, default=8, help="most drafts per step (k adapts below it)")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--skip-draft", action="store_true")
    ap.add_argument("--skip-smollm", action="store_true")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    common = dict(dtype="bf16", threads=args.threads, enable_prefix_caching=False, speculative_max_batch=64)
    if not args.skip_smollm:
        llm = LLM("smollm2-135m", quantization="none", **common)  # dense bf16: k+1 rows cost about one
        strategies(llm, ["prompt_lookup", "jacobi"], args.k, args.max_tokens,
                   ["rewrite function", "summarise passage", "free generation"])
        batch_sweep(llm, args.k, 32, [1, 8])
        del llm
        llm = LLM("smollm2-135m", **common)  # default: packed int4 layers, whose cost grows with rows
        strategies(llm, ["prompt_lookup"], args.k, args.max_tokens, ["summarise passage"])
        del llm
    if not args.skip_draft:
        code = ["rewrite function", "write code"]
        pair = dict(draft_model="qwen2.5-coder-0.5b", **common)
        llm = LLM("qwen2.5-coder-1.5b", quantization="none", **pair)  # draft: packed int4 (the default)
        strategies(llm, ["draft", "prompt_lookup"], args.k, args.max_tokens, code + ["free generation"])
        del llm
        llm = LLM("qwen2.5-coder-1.5b", quantization="none", draft_quantization="none", **pair)  # the old way
        strategies(llm, ["draft"], args.k, args.max_tokens, code[:1])
        del llm
        llm = LLM("qwen2.5-coder-1.5b", quantization="int4", **pair)  # packed target: verify costs ~k steps
        strategies(llm, ["draft"], args.k, args.max_tokens, code[:1])
    print("\n(speed-up = strategy tok/s ÷ plain tok/s of the same model and task in this run; dec = after the "
          "first token; same text = identical token ids to plain greedy)")


if __name__ == "__main__":
    main()
