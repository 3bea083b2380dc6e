"""Two versions of tokenhaul side by side: fresh processes alternate between source trees (a git revision is
checked out into a temporary worktree), each loads the model as a user would (default settings: the compiled
batch-1 step where one is saved), warms up, then generates; decode tok/s from the ledger's decode steps. Prints
per tree the median and every round, the ratio, and whether greedy texts agree.

    flock -x /tmp/tokenhaul-bench.lock .venv/bin/python bench/ab_trees.py --models smollm2-135m before=@HEAD~1 now=.

A tree's compiled step is saved by its first run (`--prepare` runs each tree once and waits for the detached
compile), so time only after that.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CHILD = r"""
import json, sys
from tokenhaul import LLM, SamplingParams
model, sparsity = sys.argv[1], float(sys.argv[4])
batch, new, context = (int(a) for a in (sys.argv[2], sys.argv[3], sys.argv[5]))
llm = LLM(model, sparsity=sparsity)
filler = "The harbour was quiet that night. " * (context // 7)  # ~7 tokens each
prompts = [f"{filler}Write a long story about a harbour, number {i}." for i in range(batch)]
llm.generate(prompts, SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))
outs = llm.generate(prompts, SamplingParams(max_tokens=new, temperature=0, ignore_eos=True))
steps = [s for s in outs[0].ledger.steps if not s.is_prefill]
print(json.dumps({"tps": sum(s.num_sampled for s in steps) / sum(s.seconds for s in steps),
                  "text": [o.text for o in outs]}))
"""


def run(tree: Path, model: str, batch: int, new: int, sparsity: float, context: int = 0) -> dict:
    env = dict(os.environ, PYTHONPATH=str(tree))
    out = subprocess.run([sys.executable, "-c", CHILD, model, str(batch), str(new), str(sparsity), str(context)],
                         env=env, cwd=tree, capture_output=True, text=True)
    if out.returncode:
        sys.exit(f"{tree}: {out.stderr[-2000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def wait_for_compiles() -> None:
    while subprocess.run(["pgrep", "-f", "tokenhaul.engine.compiled_decode"], capture_output=True).returncode == 0:
        time.sleep(5)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("trees", nargs=2, help="NAME=PATH or NAME=@REVISION")
    ap.add_argument("--models", default="smollm2-135m,qwen2.5-coder-0.5b")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--sparsity", type=float, default=0.0, help="activation sparsity of both trees (0: dense)")
    ap.add_argument("--context", type=int, default=0, help="prompt tokens before the question (about; 0: none)")
    ap.add_argument("--rounds", type=int, default=6, help="processes per tree, alternating (order flips each round)")
    ap.add_argument("--prepare", action="store_true", help="first run each tree once and wait for its compile")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        trees = {}
        for spec in args.trees:
            name, _, source = spec.partition("=")
            if source.startswith("@"):
                path = Path(tmp) / name
                subprocess.run(["git", "worktree", "add", "--detach", str(path), source[1:]], cwd=ROOT, check=True,
                               capture_output=True)
                trees[name] = path
            else:
                trees[name] = Path(source).resolve()
        try:
            print("| model | batch | " + " | ".join(f"{n} tok/s (rounds)" for n in trees) + " | ratio | same text |")
            print("|---|---|---|---|---|---|")
            for model in args.models.split(","):
                if args.prepare:
                    for tree in trees.values():
                        run(tree, model, args.batch, 8, args.sparsity)
                        wait_for_compiles()
                rates: dict[str, list[float]] = {n: [] for n in trees}
                texts = {}
                for r in range(args.rounds):
                    for name in (list(trees) if r % 2 == 0 else list(trees)[::-1]):
                        out = run(trees[name], model, args.batch, args.new_tokens, args.sparsity, args.context)
                        rates[name].append(out["tps"])
                        texts[name] = out["text"]
                a, b = (statistics.median(rates[n]) for n in trees)
                cells = [f"{statistics.median(v):.1f} ({' '.join(f'{x:.0f}' for x in v)})" for v in rates.values()]
                print(f"| {model} | {args.batch} | " + " | ".join(cells) +
                      f" | {b / a:.3f} | {len({json.dumps(t) for t in texts.values()}) == 1} |", flush=True)
        finally:
            for path in trees.values():
                if str(path).startswith(tmp):
                    subprocess.run(["git", "worktree", "remove", "--force", str(path)], cwd=ROOT, capture_output=True)


if __name__ == "__main__":
    main()
