"""What an int8 KV cache costs in quality at long context, read through the decode path: a prompt of CONTEXT
tokens of corpus text is prefilled, then the next TAIL tokens of the same text are fed one per decode step (the
decode attention kernel reads the cache, as in generation). Each step's next-token distribution is compared with
bf16 KV's at the same position: mean KL, top-1 agreement, and the text's NLL.

Rows: bf16 KV (the reference), int8 KV as the engine runs it (keys less their calibrated centers,
kv/key_centers.py), and int8 KV with zero centers (as before the centers). Teacher-forced, so one early
difference does not turn every later token (free-running greedy agreement, bench/bytes.py, does).

    python bench/kv_quality.py [--models smollm2-135m,qwen2.5-coder-0.5b] [--context 3840] [--tail 256]
                               [--parts en,code] [--json bench/kv-quality.json]
"""

from __future__ import annotations

import argparse
import json
import math
import time

import torch

from tokenhaul import LLM, SamplingParams
from tokenhaul.eval.perplexity import CORPUS_DIR, teacher_forced


@torch.inference_mode()
def tail_logprobs(llm: LLM, ids: list[int], context: int) -> torch.Tensor:
    """[len(ids) - context, vocab]: the prefill's last row, then one decode step per fed token."""
    core, model = llm.core, llm.model
    tail = len(ids) - context
    core.add_request("q", ids[:context], SamplingParams(max_tokens=tail + 1, ignore_eos=True))
    try:
        sched = core.scheduler.schedule()
        inp = core.runner.prepare(sched)
        last = model.compute_logits(model.forward(inp.input_ids, inp.meta, core.kv)[-1:]).float()
        return torch.cat([torch.log_softmax(last, -1), *teacher_forced(core, sched, "q", ids[context:-1])])
    finally:
        core.abort("q")


def compare(ref: torch.Tensor, logp: torch.Tensor, targets: torch.Tensor) -> dict:
    return {"kl": float((ref.exp() * (ref - logp)).sum(-1).mean()),
            "top1_agreement": float((logp.argmax(-1) == ref.argmax(-1)).float().mean()),
            "nll": float(-logp.gather(1, targets[:, None]).mean())}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default="smollm2-135m,qwen2.5-coder-0.5b")
    ap.add_argument("--context", type=int, default=3840)
    ap.add_argument("--tail", type=int, default=256)
    ap.add_argument("--parts", default="en,code")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    kw = dict(compile="off", max_num_batched_tokens=args.context, enable_prefix_caching=False)
    rows = []
    for model in args.models.split(","):
        llms = {"bf16": LLM(model, kv_dtype="bf16", **kw), "int8": LLM(model, kv_dtype="int8", **kw)}
        centers = torch.stack([k.center.clone() for k in llms["int8"].core.kv.k])
        for part in args.parts.split(","):
            text = (CORPUS_DIR / f"{part}.txt").read_text(encoding="utf-8")
            ids = llms["bf16"].tokenizer.encode(text)[:args.context + args.tail]
            targets = torch.tensor(ids[args.context:])
            t0 = time.perf_counter()
            ref = tail_logprobs(llms["bf16"], ids, args.context)
            variants = {"bf16": ref, "int8": tail_logprobs(llms["int8"], ids, args.context)}
            llms["int8"].core.kv.set_key_centers(torch.zeros_like(centers))
            variants["int8, zero centers"] = tail_logprobs(llms["int8"], ids, args.context)
            llms["int8"].core.kv.set_key_centers(centers)
            for name, logp in variants.items():
                rows.append({"model": model, "part": part, "kv": name, "context": args.context, "tail": len(targets),
                             **compare(ref, logp, targets)})
            print(f"{model} {part}: {time.perf_counter() - t0:.0f} s", flush=True)
        del llms
    print(f"\nDecode path at {args.context} keys, {args.tail} teacher-forced tokens; KL and top-1 against bf16 KV:\n")
    print("| model | text | KV | KL (nats) | top-1 agree | NLL | ppl | ppl ÷ bf16 |")
    print("|---|---|---|---|---|---|---|---|")
    base = {(r["model"], r["part"]): r["nll"] for r in rows if r["kv"] == "bf16"}
    for r in rows:
        ratio = math.exp(r["nll"] - base[(r["model"], r["part"])])
        print(f"| {r['model']} | {r['part']} | {r['kv']} | {r['kl']:.5f} | {r['top1_agreement']:.3f} | "
              f"{r['nll']:.4f} | {math.exp(r['nll']):.3f} | {ratio:.4f} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
