"""Tree search with a checker as the reward: a completion scores 1 when the function it completes parses
and passes a hidden assert (run in a subprocess, 5 s limit), else 0; plus its mean log-probability / 100 to
break ties. Greedy decoding is the search's first rollout, so the table shows where searching beats it.

    python examples/tree_search_code.py [--model qwen2.5-coder-0.5b] [--levels 3] [--width 4]
"""

from __future__ import annotations

import argparse
import ast
import subprocess
import sys
import time

from tokenhaul.decoding.tree_search import Rollout, mean_logprob, tree_search
from tokenhaul.llm import LLM

TASKS = [  # (signature + docstring given to the model, hidden assert)
    ('def is_palindrome(s: str) -> bool:\n    """True if s reads the same both ways, ignoring case and '
     'non-alphanumeric characters."""\n',
     'assert is_palindrome("A man, a plan, a canal: Panama") and not is_palindrome("race a car")'),
    ('def second_largest(xs: list[int]) -> int:\n    """The second largest distinct value in xs."""\n',
     'assert second_largest([3, 1, 3, 2]) == 2 and second_largest([5, 5, 4]) == 4'),
    ('def run_length(s: str) -> str:\n    """Run-length encode s, e.g. \'aaabcc\' -> \'a3b1c2\'."""\n',
     'assert run_length("aaabcc") == "a3b1c2" and run_length("") == ""'),
    ('def digits_sum(n: int) -> int:\n    """Sum of the decimal digits of n (n may be negative)."""\n',
     'assert digits_sum(-123) == 6 and digits_sum(0) == 0'),
    ('def rotate(xs: list, k: int) -> list:\n    """Rotate xs right by k steps (k may exceed len(xs))."""\n',
     'assert rotate([1, 2, 3, 4, 5], 7) == [4, 5, 1, 2, 3] and rotate([], 3) == []'),
    ('def merge_intervals(iv: list[list[int]]) -> list[list[int]]:\n    """Merge overlapping [start, end] '
     'intervals; return them sorted."""\n',
     'assert merge_intervals([[8, 10], [1, 3], [2, 6]]) == [[1, 6], [8, 10]]'),
    ('def title_case(s: str) -> str:\n    """Capitalize the first letter of every word and lowercase the '
     'rest."""\n',
     'assert title_case("hELLO wORLD") == "Hello World"'),
    ('def flatten(xs: list) -> list:\n    """Flatten arbitrarily nested lists."""\n',
     'assert flatten([1, [2, [3, [4]], 5]]) == [1, 2, 3, 4, 5]'),
]
STOP = ["\ndef ", "\nclass ", "\nif __name__", "\nprint(", "\nassert", "\n#", "\n```"]


def function_source(prompt: str, completion: str) -> str:
    """The prompt's function as completed: lines up to the first non-indented one after the def."""
    lines = (prompt + completion).split("\n")
    end = next((i for i, ln in enumerate(lines[1:], 1) if ln.strip() and not ln.startswith((" ", "\t"))),
               len(lines))
    return "\n".join(lines[:end])


def passes(prompt: str, completion: str, check: str) -> bool:
    src = function_source(prompt, completion)
    try:
        ast.parse(src)
    except SyntaxError:
        return False
    try:
        run = subprocess.run([sys.executable, "-c", src + "\n" + check], capture_output=True, timeout=5)
    except subprocess.TimeoutExpired:
        return False
    return run.returncode == 0


def checker(prompt: str, check: str):
    def reward(r: Rollout) -> float:
        return float(passes(prompt, r.text, check)) + mean_logprob(r) / 100

    return reward


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="qwen2.5-coder-0.5b")
    ap.add_argument("--levels", type=int, default=3)
    ap.add_argument("--width", type=int, default=4)
    ap.add_argument("--top-k", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=96)
    args = ap.parse_args()
    llm = LLM(args.model)
    rows = []
    for prompt, check in TASKS:
        t0 = time.perf_counter()
        res = tree_search(llm, prompt, checker(prompt, check), levels=args.levels, width=args.width,
                          top_k=args.top_k, max_tokens=args.max_tokens, stop=STOP)
        first = next((i for i, r in enumerate(res.rollouts) if r.reward >= 0.5), None)
        shared = 1 - res.computed_prompt_tokens / max(1, res.prompt_tokens)
        rows.append((prompt.split("(")[0][4:], res.greedy.reward >= 0.5, res.best.reward >= 0.5,
                     "-" if first is None else str(first + 1), len(res.rollouts), shared, time.perf_counter() - t0))
        assert llm.core.pool.num_used == 0  # every rollout's KV blocks came back
    print(f"model {args.model}, {args.levels} levels x {args.width} rollouts, top-{args.top_k} children, "
          f"max {args.max_tokens} tokens\n")
    print(f"{'task':<18}{'greedy':>8}{'search':>8}{'first pass':>12}{'rollouts':>10}{'KV reused':>11}{'seconds':>9}")
    for name, g, s, first, n, shared, sec in rows:
        print(f"{name:<18}{'pass' if g else 'fail':>8}{'pass' if s else 'fail':>8}{first:>12}{n:>10}"
              f"{shared:>10.0%}{sec:>9.1f}")
    print("KV reused: share of rollout prompt tokens (prompt + tree path) not computed: forked from the rollout "
          "a branch leaves, or cached")
    g, s = sum(r[1] for r in rows), sum(r[2] for r in rows)
    print(f"\npassed: greedy {g}/{len(rows)}, tree search {s}/{len(rows)}")


if __name__ == "__main__":
    main()
