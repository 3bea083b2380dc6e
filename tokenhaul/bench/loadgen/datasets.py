"""Prompts to send: random common words, a mix of long and short, or a file's."""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from pathlib import Path

_WORDS = (
    "the of and to in is was for on with as by at from that this be are it an or have had not but "
    "which one all were we when there can been has more if will would who so no time its only new "
    "about other into some could them then than first may any these two like people over such our "
    "many most also after made work way should well year before between where under while water "
    "city house world school country paper music river light winter garden market engine memory "
    "number system story morning question family window letter station mountain language history"
).split()


@dataclass
class PromptSpec:
    prompt: str | list[int]
    max_tokens: int


def random_dataset(n: int, input_len: int, output_len: int, range_ratio: float = 0.0,
                   seed: int = 0) -> list[PromptSpec]:
    """Text prompts of about input_len common words (≈ tokens in BPE vocabularies), distinct per
    request (a random lead so prefix caching cannot share them), max_tokens = output_len (± ratio)."""
    rng = random.Random(seed)

    def jitter(x: int) -> int:
        lo, hi = int(x * (1 - range_ratio)), int(x * (1 + range_ratio))
        return max(1, rng.randint(lo, hi))

    out = []
    for i in range(n):
        words = [str(rng.randrange(10**6)), *(rng.choice(_WORDS) for _ in range(jitter(input_len) - 1))]
        out.append(PromptSpec(f"{i} " + " ".join(words), jitter(output_len)))
    return out


def mixed_dataset(n: int, short_len: int, long_len: int, long_fraction: float, output_len: int,
                  seed: int = 0) -> list[PromptSpec]:
    """random_dataset's prompts: round(n · long_fraction) of them, at seeded places, long_len words,
    the rest short_len (both ± 20 %); exactly output_len new tokens each."""
    is_long = set(random.Random(seed).sample(range(n), round(n * long_fraction)))
    short = random_dataset(n, short_len, output_len, 0.2, seed)
    long = random_dataset(n, long_len, output_len, 0.2, seed + 1)
    return [PromptSpec((long if i in is_long else short)[i].prompt, output_len) for i in range(n)]


def file_dataset(path: str | Path, n: int, output_len: int) -> list[PromptSpec]:
    """JSONL ({"prompt": str | [ids], "max_tokens": int}) or plain text (one prompt per line); cycled to n."""
    specs = []
    for line in Path(path).read_text().splitlines():
        if not line.strip():
            continue
        if Path(path).suffix in (".jsonl", ".json") and line.lstrip().startswith("{"):
            obj = json.loads(line)
            specs.append(PromptSpec(obj["prompt"], int(obj.get("max_tokens", obj.get("output_len", output_len)))))
        else:
            specs.append(PromptSpec(line, output_len))
    if not specs:
        raise ValueError(f"{path}: no prompts")
    return [specs[i % len(specs)] for i in range(n)]
