"""glibc keeping freed memory (tokenhaul's default: host.keep_freed_memory) vs handing it back at once (glibc's
default, TOKENHAUL_KEEP_FREED_MEMORY=0), side by side: child processes alternate the two (the policy holds from
the process's start, as it does in use). Per model and batch size: generated tokens/s (prefill included, as
bench/speed.py's decode rows), the page faults and the kernel CPU time of the measured generation, and the
process's resident memory after it.

    flock /tmp/tokenhaul-bench.lock .venv/bin/python bench/malloc_policy.py --models qwen2.5-coder-0.5b
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

CHILD = """
import json, resource, sys, time
sys.path.insert(0, {bench!r})
from tokenhaul import LLM, SamplingParams
from peers import synthetic_prompt
llm = LLM({model!r})
def run(batch, new, seed):
    prompts = [synthetic_prompt(64, seed=seed * 1000 + i) for i in range(batch)]  # fresh: no prefix-cache hits
    return llm.generate(prompts, SamplingParams(max_tokens=new, temperature=0, ignore_eos=True))
run({batch}, 4, 1)
before, t0 = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter()
outs = run({batch}, {new}, 2)
wall, after = time.perf_counter() - t0, resource.getrusage(resource.RUSAGE_SELF)
rss = next(int(x.split()[1]) for x in open("/proc/self/status") if x.startswith("VmRSS:")) / 1024
print(json.dumps({{"tps": sum(len(o.token_ids) for o in outs) / wall, "faults": after.ru_minflt - before.ru_minflt,
                  "sys_s": after.ru_stime - before.ru_stime, "cpu_s": after.ru_utime - before.ru_utime
                  + after.ru_stime - before.ru_stime, "rss_mb": rss}}))
"""


def child(model: str, batch: int, new: int, keep: bool) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_")}
    env["TOKENHAUL_KEEP_FREED_MEMORY"] = "1" if keep else "0"
    code = CHILD.format(bench=str(Path(__file__).resolve().parent), model=model, batch=batch, new=new)
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", default="smollm2-135m,qwen2.5-coder-0.5b")
    ap.add_argument("--batches", default="1,32")
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=3, help="processes per policy, alternating")
    args = ap.parse_args()
    print("| model | batch | policy | tok/s (median) | rounds | page faults | kernel CPU % | RSS MB | kept ÷ default |")
    print("|---|---|---|---|---|---|---|---|---|")
    for model in args.models.split(","):
        for batch in (int(b) for b in args.batches.split(",")):
            runs: dict[bool, list[dict]] = {False: [], True: []}
            for _ in range(args.rounds):
                for keep in (False, True):
                    runs[keep].append(child(model, batch, args.new_tokens, keep))
            med = {k: statistics.median(r["tps"] for r in v) for k, v in runs.items()}
            for keep, r in runs.items():
                ratio = f"{med[True] / med[False]:.2f}×" if keep else ""
                each = ", ".join(f"{x['tps']:.1f}" for x in r)
                print(f"| {model} | {batch} | {'kept' if keep else 'glibc default'} | {med[keep]:.1f} | "
                      f"{each} | {statistics.median(x['faults'] for x in r):.0f} | "
                      f"{statistics.median(100 * x['sys_s'] / x['cpu_s'] for x in r):.1f} | "
                      f"{statistics.median(x['rss_mb'] for x in r):.0f} | {ratio} |", flush=True)


if __name__ == "__main__":
    main()
