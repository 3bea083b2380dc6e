"""Fewer bytes per token: quantization × KV dtype × activation sparsity, side by side in one run.

For each option: weight and KV bytes per decoded token (ledger), decode tok/s at batch 1 and 8 at
context 512 and 4096, perplexity (`eval ppl`'s harness, short windows; long windows for the KV rows),
greedy agreement at each context with the same bits dense (else the model's first row: int8 KV against bf16 KV
at 4 k keys is the KV dtype's cost through the decode kernel); then a fit of seconds per token
against bytes per token.
The batch-8 rows at 4096 share one cached prefix (prefill once), each sequence still attends its own 4 k.

    flock -x /tmp/tokenhaul-bench.lock .venv/bin/python bench/bytes.py [--quick]

Every option runs with the same `--compile` (default off: every row eager; `on`: every row's batch-1 decode as
one compiled graph, sparse rows included); the header names the commit and each option's linear kernels.

The whole grid takes ~27 min; under the exclusive lock run it in parts of a few minutes, each with its own
baseline row (the first option of a model is its reference), e.g. speed only:

    bench/bytes.py --models smollm2-135m --no-ppl --no-kernels --json bench/bytes-smollm2.json
    bench/bytes.py --models smollm2-135m --options none/bf16/0,none/int8/0,auto/bf16/0,auto/int8/0 ...
"""

from __future__ import annotations

import argparse
import json
import subprocess
import time
from pathlib import Path

import numpy as np
import torch

from tokenhaul import LLM, SamplingParams
from tokenhaul.eval.perplexity import CORPUS_DIR, evaluate

# (model, quantization, kv dtype, sparsity): a subset of the grid that isolates each option against its
# own baseline (same bits), not the full product (which would take ~4x the run time).
GRID = [
    ("smollm2-135m", "none", "bf16", 0.0),
    ("smollm2-135m", "none", "int8", 0.0),
    ("smollm2-135m", "none", "bf16", 0.4),
    ("smollm2-135m", "int8", "bf16", 0.0),
    ("smollm2-135m", "int8", "bf16", 0.4),
    ("smollm2-135m", "int8", "int8", 0.0),
    ("smollm2-135m", "auto", "bf16", 0.0),
    ("smollm2-135m", "auto", "int8", 0.0),
    ("smollm2-135m", "auto", "bf16", 0.4),
    ("qwen2.5-coder-0.5b", "auto", "bf16", 0.0),
    ("qwen2.5-coder-0.5b", "auto", "int8", 0.0),
    ("qwen2.5-coder-0.5b", "int8", "bf16", 0.0),
    ("qwen2.5-coder-0.5b", "int8", "bf16", 0.4),
    ("qwen2.5-coder-0.5b", "auto", "bf16", 0.4),
]
NEW = 24  # decoded tokens per measurement
CONTEXTS = [512, 4096]  # --contexts 512 drops the 4 k cells
REPEATS = 3  # measurements per cell, median (12 tokens once let one disturbed step move a cell by 40 %)


def text_prompts(llm: LLM, n: int, length: int) -> list[list[int]]:
    ids = llm.tokenizer.encode((CORPUS_DIR / "en.txt").read_text(encoding="utf-8")
                               + (CORPUS_DIR / "code.txt").read_text(encoding="utf-8"))
    step = (len(ids) - length) // n
    return [ids[i * step:i * step + length] for i in range(n)]


def decode_rate(llm: LLM, prompts: list[list[int]]) -> tuple[float, dict, list[list[int]]]:
    """Median decode tok/s of REPEATS runs of NEW tokens (the prompts are cached after the first)."""
    params = SamplingParams(max_tokens=NEW, temperature=0, ignore_eos=True)
    rates = []
    for _ in range(REPEATS):
        outs = llm.generate(prompts, params)
        s = outs[0].ledger.summary()
        rates.append(s["decode_tokens_per_s"])
    return sorted(rates)[len(rates) // 2], s, [o.token_ids for o in outs]


def run_option(model: str, quant: str, kv: str, sparsity: float, ref: dict | None, ppl: bool, long_ppl: bool,
               compile_mode: str) -> dict:
    t0 = time.perf_counter()
    llm = LLM(model, quantization=quant, kv_dtype=kv, sparsity=sparsity, max_num_batched_tokens=4096,
              max_num_seqs=8, kv_memory_gib=0.5, compile=compile_mode)
    load_s = time.perf_counter() - t0
    row = {"model": model, "quantization": quant, "kv_dtype": kv, "sparsity": sparsity, "load_s": load_s,
           "kernels": kernels(llm), "compiled_decode": llm.config.compiled_decode}
    llm.generate([1, 2, 3, 4], SamplingParams(max_tokens=2))  # warm up
    p512 = text_prompts(llm, 8, 500)
    for ctx, base in ((512, p512), (4096, None))[:len(CONTEXTS)]:
        if base is None:  # one 4080-token prefix, cached once; 8 sequences differ in their last tokens
            prefix = text_prompts(llm, 1, 4080)[0]
            llm.generate(prefix, SamplingParams(max_tokens=1))
            base = [prefix + [100 + i] for i in range(8)]
        r1, s1, _ = decode_rate(llm, base[:1])
        r8, s8, toks = decode_rate(llm, base)
        row[f"tps_b1_{ctx}"], row[f"tps_b8_{ctx}"] = r1, r8
        row[f"tokens_{ctx}"] = toks
        if ctx == 512:
            row["weight_bytes_per_token"] = s1["weight_bytes_per_token"]
            row["kv_bytes_per_token_512"] = s1["kv_bytes_per_token"]
        else:
            row["kv_bytes_per_token_4096"] = s1["kv_bytes_per_token"]
    for ctx in (512, 4096)[len(CONTEXTS):]:  # not measured: blank cells
        row[f"tps_b1_{ctx}"] = row[f"tps_b8_{ctx}"] = row[f"kv_bytes_per_token_{ctx}"] = float("nan")
    if sparsity:
        row.update(kernel_count(llm, p512[0]))
    llm.core.prefix_cache.enabled = False  # perplexity windows must each be one computed prefill chunk
    if ppl:
        row["ppl"] = evaluate(llm, None, 1536, 512, 256)["perplexity"]
    if ppl and long_ppl:  # one 4096-token window of English prose: the KV dtype's effect at long context
        row["ppl_long"] = evaluate(llm, CORPUS_DIR / "en.txt", 4096, 4096, 4096)["perplexity"]
    for ctx in CONTEXTS if ref is not None else ():  # greedy tokens equal to the reference's, at each context
        pairs = [(a, b) for ra, rb in zip(ref[f"tokens_{ctx}"], row[f"tokens_{ctx}"]) for a, b in zip(ra, rb)]
        row["agreement" if ctx == 512 else f"agreement_{ctx}"] = sum(a == b for a, b in pairs) / len(pairs)
    row["seconds"] = time.perf_counter() - t0
    return row


def kernels(llm: LLM) -> str:
    """The linear classes one layer and the lm_head run (a SparseLinear names its storage and fallback)."""
    def name(lin) -> str:
        if hasattr(lin, "threshold"):
            return f"Sparse[{lin.storage}{'' if lin.packed is None else ' / ' + type(lin.packed).__name__}]"
        return type(lin).__name__
    layer = llm.model.layers[0]
    return f"layers {'/'.join(sorted({name(getattr(layer, n)) for n in ('qkv', 'o', 'gate_up', 'down')}))}, " \
           f"lm_head {name(llm.model.lm_head)}"


def kernel_count(llm: LLM, prompt: list[int]) -> dict:
    """The sparse kernels' own count of weight-row bytes read (SparseLinear.touched_bytes) against the
    ledger's, over one request whose prompt is already cached (a short prefill tail, then NEW decodes)."""
    sparse = [v for layer in llm.model.layers for v in vars(layer).values() if hasattr(v, "touched_bytes")]
    sparse += [llm.model.lm_head] if hasattr(llm.model.lm_head, "touched_bytes") else []
    llm.generate(prompt, SamplingParams(max_tokens=1))  # cache the prompt's blocks
    for lin in sparse:
        lin.touched_bytes = 0
    out = llm.generate(prompt, SamplingParams(max_tokens=NEW, temperature=0, ignore_eos=True))[0]
    mc, steps = llm.costs, out.ledger.steps
    other = sum(mc.norm_bytes + sum(n for _, _, n in s.record.chunks) * mc.embed_row_bytes for s in steps)
    ledger = sum(s.costs.weight_bytes for s in steps) - other
    touched = sum(lin.touched_bytes for lin in sparse)
    return {"kernel_rows_ratio": touched / ledger, "kernel_weight_bytes_per_token": (touched + other) / NEW,
            "kernel_sparse_linears": len(sparse)}


def crossover(reps: int = 3) -> None:
    """Gathered (sparse 0.4) vs dense kernels of all 120 SmolLM2 layer projections at M rows, min of reps,
    interleaved: where the gathered path stops paying (linear_sparse.MAX_ROWS)."""
    from tokenhaul.layers.linear_dense import DenseLinear
    from tokenhaul.layers.linear_int4 import Int4Linear
    from tokenhaul.layers.linear_int8 import Int8Linear
    from tokenhaul.layers.linear_sparse import SparseLinear

    cpu = torch.device("cpu")
    shapes = [(576, 960), (576, 576), (576, 3072), (1536, 576)] * 30
    builds = {"bf16": lambda w: DenseLinear.build([w], None, torch.bfloat16, cpu),
              "int8": lambda w: Int8Linear.build([w], None, torch.bfloat16, cpu),
              "int4": lambda w: Int4Linear.build([w], None, torch.bfloat16, cpu, 32)}
    print("\n| kernel | M | dense ms | gathered ms (0.4) | dense / gathered |\n|---|---|---|---|---|")
    for name, build in builds.items():
        dense = [build(torch.randn(o, i) * 0.05) for i, o in shapes]
        sparse = [SparseLinear.wrap(d, 0.0, max_rows=64) for d in dense]
        for m in (1, 2, 4, 8):
            xs = [torch.randn(m, i) for i, _ in shapes]
            for sp, x in zip(sparse, xs):
                sp.threshold = float(torch.quantile(x.abs().flatten(), 0.4))
            best = {"d": 1e9, "s": 1e9}
            for _ in range(reps):
                for key, lins in (("d", dense), ("s", sparse)):
                    t = time.perf_counter()
                    for lin, x in zip(lins, xs):
                        lin(x)
                    best[key] = min(best[key], time.perf_counter() - t)
            print(f"| {name} | {m} | {best['d'] * 1e3:.1f} | {best['s'] * 1e3:.1f} | {best['d'] / best['s']:.2f} |",
                  flush=True)


def fit(rows: list[dict]) -> tuple[float, float, float]:
    """seconds per token = t0 + bytes / bw over the batch-1 rows at 512 and 4096; returns (bw, t0, R²)."""
    x, y = [], []
    for r in rows:
        for ctx in CONTEXTS:
            x.append(r["weight_bytes_per_token"] + r[f"kv_bytes_per_token_{ctx}"])
            y.append(1.0 / r[f"tps_b1_{ctx}"])
    x, y = np.array(x), np.array(y)
    slope, t0 = np.polyfit(x, y, 1)
    pred = t0 + slope * x
    r2 = 1 - ((y - pred) ** 2).sum() / ((y - y.mean()) ** 2).sum()
    return 1 / slope, t0, r2


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--quick", action="store_true", help="SmolLM2 rows only")
    ap.add_argument("--models", default="", help="comma-separated models of GRID to run (default: all)")
    ap.add_argument("--options", default="", help="comma-separated quant/kv/sparsity of GRID, e.g. none/int8/0")
    ap.add_argument("--no-ppl", action="store_true", help="speed and bytes only (perplexity: the full run's)")
    ap.add_argument("--no-kernels", action="store_true", help="skip the gathered-vs-dense kernel table")
    ap.add_argument("--contexts", default="512,4096", choices=["512", "512,4096"])
    ap.add_argument("--json", default="bench/bytes.json")
    ap.add_argument("--compile", default="off", choices=["off", "auto", "on"],
                    help="the batch-1 compiled step for every option: on compiles it at load (a minute cold), "
                         "auto only loads one saved before (fp32 stays eager)")
    args = ap.parse_args()
    rev = subprocess.run(["git", "log", "-1", "--format=%h %cI %s"], capture_output=True, text=True,
                         cwd=Path(__file__).parent).stdout.strip()
    print(f"commit {rev[:100]}; --compile {args.compile}; {args.threads} threads", flush=True)
    CONTEXTS[:] = [int(c) for c in args.contexts.split(",")]
    torch.set_num_threads(args.threads)
    if not args.no_kernels:
        crossover()
    models = set(args.models.split(",")) if args.models else {"smollm2-135m"} if args.quick else None
    options = {tuple(o.split("/")) for o in args.options.split(",")} if args.options else None
    rows: list[dict] = []
    refs: dict[str, dict] = {}
    for model, quant, kv, sp in GRID:
        if (models and model not in models) or (options and (quant, kv, f"{sp:g}") not in options):
            continue
        same_bits = [r for r in rows if (r["model"], r["quantization"], r["kv_dtype"], r["sparsity"]) ==
                     (model, quant, kv, 0.0)]  # agreement: with the same bits dense, else the model's first row
        r = run_option(model, quant, kv, sp, (same_bits or [refs.get(model)])[0], not args.no_ppl,
                       long_ppl=(sp == 0.0 and model == "smollm2-135m"), compile_mode=args.compile)
        refs.setdefault(model, r)
        rows.append(r)
        print(f"{model} {quant}/{kv}/{sp}: done in {r['seconds']:.0f} s; {r['kernels']}; compiled decode "
              f"{r['compiled_decode']}", flush=True)
    print("\n| model | quant | KV | sparsity | weight MB/tok | KV kB/tok @512 / @4096 | tok/s b1 512 | b8 512 | "
          "b1 4096 | b8 4096 | ppl (512 win) | ppl (4096 win, en) | greedy agree | @4096 |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['model']} | {r['quantization']} | {r['kv_dtype']} | {r['sparsity']:g} | "
              f"{r['weight_bytes_per_token'] / 1e6:.1f} | {r['kv_bytes_per_token_512'] / 1e3:.0f} / "
              f"{r['kv_bytes_per_token_4096'] / 1e3:.0f} | {r['tps_b1_512']:.1f} | {r['tps_b8_512']:.1f} | "
              f"{r['tps_b1_4096']:.1f} | {r['tps_b8_4096']:.1f} | {r.get('ppl', float('nan')):.3f} | "
              f"{r.get('ppl_long', float('nan')):.3f} | {r.get('agreement', 1.0):.2f} | "
              f"{r.get('agreement_4096', 1.0 if 4096 in CONTEXTS else float('nan')):.2f} |")
    for r in rows:
        if "kernel_rows_ratio" in r:
            print(f"kernel count {r['model']} {r['quantization']}/{r['kv_dtype']}/{r['sparsity']:g}: "
                  f"{r['kernel_sparse_linears']} sparse linears read {r['kernel_weight_bytes_per_token'] / 1e6:.1f} MB "
                  f"per token (with norms and embedding rows); rows touched / ledger rows "
                  f"{r['kernel_rows_ratio']:.3f}")
    for model in refs:
        mr = [r for r in rows if r["model"] == model]
        if len(mr) < 2:
            continue
        bw, t0, r2 = fit(mr)
        print(f"\nfit {model}: s/token = {t0 * 1e3:.1f} ms + bytes / {bw / 1e9:.2f} GB/s  (R² {r2:.2f}, batch 1)")
        for r in mr:
            for ctx in CONTEXTS:
                b = r["weight_bytes_per_token"] + r[f"kv_bytes_per_token_{ctx}"]
                pred = 1 / (t0 + b / bw)
                off = r[f"tps_b1_{ctx}"] / pred - 1
                if abs(off) > 0.2:
                    print(f"  outlier {r['quantization']}/{r['kv_dtype']}/{r['sparsity']:g} @{ctx}: "
                          f"{r[f'tps_b1_{ctx}']:.1f} tok/s vs {pred:.1f} predicted ({off:+.0%})")
    for r in rows:
        r.pop("tokens_512", None), r.pop("tokens_4096", None)
    Path(args.json).write_text(json.dumps(rows, indent=1))
    print(f"\nJSON: {args.json}")


if __name__ == "__main__":
    main()
