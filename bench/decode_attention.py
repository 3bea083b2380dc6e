"""Decode attention over mixed context lengths, the attention part of one decode step (K/V write,
block gather, SDPA) over all layers of a SmolLM2-shaped paged cache (bf16, 16-slot blocks shuffled as
after churn), contexts drawn uniformly from --min-ctx..--max-ctx:

  main     the code before issue 14's fix: one call padded to the longest context, blocks gathered
           by advanced indexing, a one-query GQA SDPA call
  padded   layers/attention.paged_attention, one call (bf16 decodes: the C++ kernel reading the blocks in
           place, kv/decode_attention.py; before it, an index_select gather and query heads folded onto their
           KV head)
  per seq  paged_attention, one call per sequence
  split    paged_attention, calls split by KV length (engine/attention_calls.py, as the runner does)

Strategies interleaved, median of --repeats, ms per step; ratios against `split`.

    flock -x /tmp/tokenhaul-bench.lock .venv/bin/python bench/decode_attention.py
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

import torch
import torch.nn.functional as F

from tokenhaul.engine.attention_calls import CALL_SLOTS, split_by_length
from tokenhaul.layers.attention import AttentionMetadata, AttnGroup, paged_attention

H, HKV, D, LAYERS, BS = 9, 3, 64, 30, 16


def metadata(lengths: list[int], tables: list[list[int]], calls: list[list[int]]) -> AttentionMetadata:
    """Decode metadata: sequence i's one query at position lengths[i] - 1, attention calls as given."""
    slots = torch.tensor([tables[i][(n - 1) // BS] * BS + (n - 1) % BS for i, n in enumerate(lengths)])
    rows = [i for c in calls for i in c]
    groups, row = [], 0
    for c in calls:
        nb = -(-max(lengths[i] for i in c) // BS)
        table = torch.tensor([(tables[i] + [0] * nb)[:nb] for i in c])
        pos = torch.tensor([lengths[i] - 1 for i in c])
        mask = (torch.arange(nb * BS)[None, :] <= pos[:, None])[:, None, None, :]
        idx = None if len(calls) == 1 else torch.arange(row, row + len(c))
        groups.append(AttnGroup(len(c), 1, idx, table, mask, mask))
        row += len(c)
    return AttentionMetadata(torch.tensor([lengths[i] - 1 for i in rows]), slots[rows], groups, len(lengths))


def main_attention(q, k, v, k_cache, v_cache, meta, scale, sliding):
    """The decode path as it was: `cache[table]` gather, one-query GQA SDPA, one padded call."""
    nb, bs, hkv, d = k_cache.shape
    k_cache.view(nb * bs, hkv, d)[meta.slot_mapping] = k
    v_cache.view(nb * bs, hkv, d)[meta.slot_mapping] = v
    (g,) = meta.groups
    qg = q.view(g.batch, 1, H, d).transpose(1, 2)
    kg = k_cache[g.block_table].reshape(g.batch, -1, hkv, d).transpose(1, 2)
    vg = v_cache[g.block_table].reshape(g.batch, -1, hkv, d).transpose(1, 2)
    o = F.scaled_dot_product_attention(qg, kg, vg, attn_mask=g.mask, scale=scale, enable_gqa=True)
    return o.transpose(1, 2).reshape(g.batch, H * d)


def step_seconds(fn, meta: AttentionMetadata, caches, q, k, v) -> float:
    t = time.perf_counter()
    for kc, vc in caches:
        fn(q, k, v, kc, vc, meta, D ** -0.5, False)
    return time.perf_counter() - t


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batches", default="1,8,24")
    ap.add_argument("--min-ctx", type=int, default=50)
    ap.add_argument("--max-ctx", type=int, default=1500)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--call-slots", type=int, default=CALL_SLOTS, help="the split's cost of one more call")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    rng = random.Random(args.seed)
    batches = [int(b) for b in args.batches.split(",")]
    per_seq = -(-args.max_ctx // BS)
    num_blocks = max(batches) * per_seq + 1
    caches = [(torch.randn(num_blocks, BS, HKV, D, dtype=torch.bfloat16),
               torch.randn(num_blocks, BS, HKV, D, dtype=torch.bfloat16)) for _ in range(LAYERS)]
    print(f"decode attention, {LAYERS} layers, heads {H}/{HKV}x{D}, bf16, contexts {args.min_ctx}-{args.max_ctx}, "
          f"{args.threads} threads, median of {args.repeats}, ms per step")
    names = ["main", "padded", "per seq", "split"]
    print(f"{'decodes':>8}" + "".join(f"{n:>10}" for n in names)
          + f"{'calls':>7}{'main/split':>12}{'padded/split':>14}")
    for b in batches:
        lengths = [rng.randint(args.min_ctx, args.max_ctx) for _ in range(b)]
        blocks = list(range(1, num_blocks))
        rng.shuffle(blocks)
        tables = [blocks[i * per_seq:(i + 1) * per_seq] for i in range(b)]
        split = split_by_length(lengths, BS, 1, args.call_slots)
        runs = {"main": (main_attention, metadata(lengths, tables, [list(range(b))])),
                "padded": (paged_attention, metadata(lengths, tables, [list(range(b))])),
                "per seq": (paged_attention, metadata(lengths, tables, [[i] for i in range(b)])),
                "split": (paged_attention, metadata(lengths, tables, split))}
        q = torch.randn(b, H, D, dtype=torch.bfloat16)
        k, v = torch.randn(b, HKV, D, dtype=torch.bfloat16), torch.randn(b, HKV, D, dtype=torch.bfloat16)
        times: dict[str, list[float]] = {n: [] for n in runs}
        with torch.inference_mode():
            for _ in range(args.repeats + 1):  # the first pass warms up
                for n, (fn, meta) in runs.items():
                    times[n].append(step_seconds(fn, meta, caches, q, k, v))
        ms = {n: statistics.median(t[1:]) * 1e3 for n, t in times.items()}
        print(f"{b:>8}" + "".join(f"{ms[n]:>10.1f}" for n in names) + f"{len(split):>7}"
              f"{ms['main'] / ms['split']:>12.2f}{ms['padded'] / ms['split']:>14.2f}", flush=True)


if __name__ == "__main__":
    main()
