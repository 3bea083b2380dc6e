"""Decode and prefill speed, one run, same GGUF and threads: tokenhaul (default settings) vs llama.cpp
(xllamacpp) vs transformers. Decode at batch 1, 8, 32 and prefill of a 512-token prompt; ratios and
the roofline fraction (ledger DRAM bytes per token × tokens/s ÷ read bandwidth). JSON saved.

Every figure is the best of `--repeats` rounds, each round tokenhaul then llama.cpp (so a slow spell of a shared
host's memory bus — 36-75 GB/s a second apart on one Zen 5 VM, the vCPUs moved between one CCD and two every
10-20 s on a Zen 4 one — lands on both engines, not one); every round's figures are kept in the JSON (`rounds`).
Each round also reads the bus (a 1 GiB sum, as the calibration does) just before tokenhaul's batch-1 decode; the
roofline fraction is the median over rounds of that round's decode bytes/s ÷ its bandwidth (the cached
calibration, measured once per machine in some other minute, is printed beside it). Where a token's bytes fit the
buffer the calibration read from the last-level cache, they are set against that cache's read bandwidth instead.

    flock /tmp/tokenhaul-bench.lock .venv/bin/python bench/speed.py --out bench/speed.json
    ... --compile off,on --batches "" --no-hf   # batch-1 decode eager vs compiled, in one run
"""

from __future__ import annotations

import argparse
import gc
import json
import platform
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

# tokenhaul first: it picks the OpenMP wait policy, which libgomp reads once, when torch loads it
from tokenhaul import LLM, SamplingParams  # noqa: E402, I001

import torch  # noqa: E402
from peers import _HF_MODELS, hf_speed, llamacpp_speed, llamacpp_throughput, synthetic_prompt  # noqa: E402

from tokenhaul.host import openmp_wait  # noqa: E402
from tokenhaul.whatif.calibrate import machine_roofline, measure_bandwidth  # noqa: E402

TARGETS = {"decode_1_vs_llamacpp": 1.0, "decode_32_vs_llamacpp": 2.0, "prefill_512_vs_llamacpp": 1.5,
           "decode_1_vs_transformers": 3.0, "roofline_fraction_1": 0.7}


def greedy(n: int) -> SamplingParams:
    return SamplingParams(max_tokens=n, temperature=0, ignore_eos=True)


def timed(llm: LLM, prompts, n: int) -> tuple[float, list]:
    t0 = time.perf_counter()
    outs = llm.generate(prompts, greedy(n))
    return time.perf_counter() - t0, outs


def decode_1(llm: LLM, new: int) -> tuple[float, dict]:
    """Batch-1 decode tokens/s (a generation of `new` tokens minus one of a single token) and its ledger summary."""
    prompt = synthetic_prompt(64)
    t1, _ = timed(llm, [prompt], 1)
    tn, outs = timed(llm, [prompt], new)
    return (new - 1) / (tn - t1), outs[0].ledger.summary()


def prefill_512(llm: LLM) -> float:
    long = synthetic_prompt(512, seed=99)
    timed(llm, [long[:256]], 1)
    wall, _ = timed(llm, [long], 1)
    return 512 / wall


def dram_bytes_per_token(llm: LLM, new: int) -> float:
    """The ledger's DRAM bytes per batch-1 decode token: weights and KV reads and writes."""
    timed(llm, [synthetic_prompt(64)], 4)  # warm up
    _, s = decode_1(llm, new)
    kv = sum(v for k, v in s["bytes_per_token"].items() if k in ("kv_read_bytes", "kv_write_bytes"))
    return s["weight_bytes_per_token"] + kv


def decode_batch(llm: LLM, new: int, b: int) -> float:
    """Tokens/s of `b` streams decoding `new` tokens each (their prefill included, as llama.cpp's figure has it)."""
    wall, outs = timed(llm, [synthetic_prompt(64, seed=i) for i in range(b)], new)
    return sum(len(o.token_ids) for o in outs) / wall


def rounds(llm: LLM, gguf: str, new: int, threads: int, repeats: int, batches: list[int]) -> list[dict]:
    """`repeats` rounds of batch-1 decode (and, where `batches` is given, prefill 512 and decode at those batches),
    tokenhaul then llama.cpp in each; each round first reads the memory bus (calibrate.measure_bandwidth), so its
    batch-1 decode is set against the bandwidth of its minute."""
    out = []
    for _ in range(repeats):
        bandwidth = measure_bandwidth("cpu", repeats=3)
        r = {"bandwidth_gb_per_s": bandwidth / 1e9, "tokenhaul": {"decode_1": decode_1(llm, new)[0]}, "llama.cpp": {}}
        r["llama.cpp"]["decode_1"] = llamacpp_speed(gguf, synthetic_prompt(64), new, threads)["decode_tokens_per_s"]
        if batches:
            r["tokenhaul"]["prefill_512"] = prefill_512(llm)
            r["llama.cpp"]["prefill_512"] = llamacpp_speed(gguf, synthetic_prompt(512, seed=99), 2,
                                                           threads)["prefill_tokens_per_s"]
        for b in batches[1:]:
            r["tokenhaul"][f"decode_{b}"] = decode_batch(llm, new, b)
            r["llama.cpp"][f"decode_{b}"] = llamacpp_throughput(gguf, [synthetic_prompt(64, seed=i) for i in range(b)],
                                                                new, b, threads)["tokens_per_s"]
        out.append(r)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--models", default="smollm2-135m,qwen2.5-coder-0.5b")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--batches", default="8,32")
    ap.add_argument("--quantization", default="auto")
    ap.add_argument("--compile", default=None,
                    help="comma list of --compile modes (auto, on, off): batch-1 decode is measured under each, the "
                         "full row under the last; default: the engine's default only")
    ap.add_argument("--no-hf", action="store_true")
    ap.add_argument("--repeats", type=int, default=3, help="rounds of every measurement (best kept)")
    ap.add_argument("--out", default="bench/speed.json")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    batches = [int(b) for b in args.batches.split(",") if b]
    roof = machine_roofline("cpu")
    result = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "machine": platform.processor() or
              platform.machine(), "threads": args.threads, "torch": torch.__version__,
              "bandwidth_gb_per_s": roof.bandwidth / 1e9, "quantization": args.quantization,
              "openmp_wait": openmp_wait(), "models": {}}
    modes = args.compile.split(",") if args.compile else [None]
    for model in args.models.split(","):
        compile_modes, lc_row = {}, {}
        for mode in modes:
            last = mode == modes[-1]
            t0 = time.perf_counter()
            llm = LLM(model, threads=args.threads, quantization=args.quantization, max_num_seqs=64,
                      max_num_batched_tokens=2048, enable_prefix_caching=False,
                      **({"compile": mode} if mode else {}))
            load_s = time.perf_counter() - t0
            gguf = llm.files.gguf_path
            compiled = llm.core.runner.compiled
            th = {"dram_bytes_per_token": dram_bytes_per_token(llm, args.new_tokens)}
            seen = rounds(llm, gguf, args.new_tokens, args.threads, args.repeats, [1, *batches] if last else [])
            for engine, row in (("tokenhaul", th), ("llama.cpp", lc_row)):
                for key in seen[0][engine]:
                    row[key] = max([r[engine][key] for r in seen] + [row.get(key, 0.0)])  # llama.cpp: all modes' rounds
            # a token's bytes that fit the buffer calibrated in the last-level cache are set against that read rate
            # (a 95 MB model in a 480 MB L3 read "114 %" of the DRAM roofline), the rest against each round's bus
            working = roof.for_working_set(th["dram_bytes_per_token"])
            th["weights_in_cache"] = working is not roof
            fractions = [th["dram_bytes_per_token"] * r["tokenhaul"]["decode_1"]
                         / (working.bandwidth if th["weights_in_cache"] else r["bandwidth_gb_per_s"] * 1e9)
                         for r in seen]
            th["roofline_fraction_1"] = statistics.median(fractions)  # each round against its own minute's bus
            th["roofline_fraction_1_rounds"] = fractions
            th["roofline_fraction_1_calibrated"] = th["dram_bytes_per_token"] * th["decode_1"] / working.bandwidth
            compile_modes[llm.config.compile] = {"decode_1": th["decode_1"], "load_s": load_s, "rounds": seen,
                                                 "compile_s": compiled.compile_seconds if compiled else None}
            del llm, compiled
            gc.collect()
        th["compile"] = compile_modes
        entry = {"tokenhaul": th, "llama.cpp": lc_row}
        if not args.no_hf:
            hf = hf_speed(gguf, synthetic_prompt(64), args.new_tokens, args.threads)
            entry["transformers"] = {"decode_1": hf["decode_tokens_per_s"]}
            _HF_MODELS.clear()
            gc.collect()
        entry["ratios"] = {k: th[k] / lc_row[k] for k in lc_row} | (
            {"decode_1_vs_transformers": th["decode_1"] / entry["transformers"]["decode_1"]} if not args.no_hf
            else {})
        result["models"][model] = entry
        print(json.dumps({model: entry}), flush=True)
    Path(args.out).write_text(json.dumps(result, indent=1))
    print(table(result))


def table(res: dict) -> str:
    cols = ["decode_1"] + [k for k in next(iter(res["models"].values()))["llama.cpp"] if k != "decode_1"]
    lines = [f"{res['date']}, {res['machine']}, {res['threads']} threads, torch {res['torch']}, "
             f"quantization {res['quantization']}, OpenMP wait {res.get('openmp_wait', '?')}, "
             f"calibrated read {res['bandwidth_gb_per_s']:.1f} GB/s "
             f"(tok/s; ratio = tokenhaul ÷ peer)", "",
             "| model | metric | tokenhaul | llama.cpp | ratio | transformers | ratio |",
             "|---|---|---|---|---|---|---|"]
    for model, e in res["models"].items():
        for c in cols:
            th, lc = e["tokenhaul"][c], e["llama.cpp"][c]
            hf = e.get("transformers", {}).get(c)
            hf_s = f"{hf:.1f} | {th / hf:.2f}×" if hf else "– | –"
            lines.append(f"| {model} | {c.replace('_', ' ')} | {th:.1f} | {lc:.1f} | {th / lc:.2f}× | {hf_s} |")
        t = e["tokenhaul"]
        lc = e["llama.cpp"]["decode_1"]
        for mode, m in t.get("compile", {}).items():
            comp = (f", compile {m['compile_s']:.1f} s" if m["compile_s"] else "" if mode == "off"
                    else ", **eager**: no saved step yet (`--compile auto` saves it at exit)")
            lines.append(f"| {model} | decode 1, --compile {mode} (load {m['load_s']:.1f} s{comp}) | "
                         f"{m['decode_1']:.1f} | {lc:.1f} | {m['decode_1'] / lc:.2f}× | | |")
        per_round = ", ".join(f"{f:.0%}" for f in t["roofline_fraction_1_rounds"])
        where = ("the last-level cache's read bandwidth (the weights fit the buffer calibrated there)"
                 if t.get("weights_in_cache") else "the read bandwidth measured in it")
        lines.append(f"| {model} | roofline fraction, batch 1: median of rounds, each round's decode ÷ {where} "
                     f"({per_round}); best round ÷ the calibration "
                     f"{t['roofline_fraction_1_calibrated']:.0%} | "
                     f"{t['roofline_fraction_1']:.0%} ({t['dram_bytes_per_token'] / 1e6:.0f} MB/token) | | | | |")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
