"""How the runner splits a step's chunks into attention calls — shared by the runner (which makes
the calls) and the step-time model (which predicts their cost), so the two never disagree.

Chunks of equal query length may share a call; a call pads every member's keys to its longest
member (in whole blocks), so a few long contexts would make every short one pay for them. Within a
query length, calls are contiguous runs of the chunks sorted by KV length, chosen by dynamic
programming to minimise padded key slots + CALL_SLOTS per call. Token arithmetic only: no torch."""

from __future__ import annotations

CALL_SLOTS = 512  # key slots one more call costs as much as, measured by bench/decode_attention.py


def attention_calls(chunks: list[tuple[int, int]], block_size: int,
                    call_slots: int = CALL_SLOTS) -> list[list[int]]:
    """chunks: (query length, KV length) each → calls as lists of chunk indices, by query length
    then KV length, shortest first; deterministic for equal inputs."""
    by_len: dict[int, list[int]] = {}
    for i, (q_len, _) in enumerate(chunks):
        by_len.setdefault(q_len, []).append(i)
    calls = []
    for q_len in sorted(by_len):
        idx = by_len[q_len]
        for run in split_by_length([chunks[i][1] for i in idx], block_size, q_len, call_slots):
            calls.append([idx[j] for j in run])
    return calls


def split_by_length(lengths: list[int], block_size: int, q_len: int = 1,
                    call_slots: int = CALL_SLOTS) -> list[list[int]]:
    """Indices into `lengths` (chunks of q_len queries each), split into calls minimising
    Σ members × q_len × padded span + calls × call_slots."""
    order = sorted(range(len(lengths)), key=lambda i: (lengths[i], i))
    span = [-(-lengths[i] // block_size) * block_size for i in order]
    n = len(order)
    best = [0] + [0] * n  # best[j]: the cheapest split of the first j sequences
    cut = [0] * (n + 1)
    for j in range(1, n + 1):
        s = span[j - 1]
        best[j], cut[j] = min((best[i] + (j - i) * q_len * s + call_slots, i) for i in range(j))
    calls = []
    j = n
    while j:
        calls.append(order[cut[j]:j])
        j = cut[j]
    return calls[::-1]

