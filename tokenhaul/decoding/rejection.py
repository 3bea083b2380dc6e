"""The accept rule of speculative decoding: which of k draft tokens the target keeps.

Greedy: keep drafts while each equals the target's argmax, then add the target's own next token
(lossless: the output is plain greedy's). Sampled: exact rejection sampling (Leviathan et al. 2023):
keep draft d with probability min(1, p(d) / q(d)); at the first rejection draw from
norm(max(p - q, 0)); after k acceptances draw a bonus token from p. q is the draft's distribution,
or one-hot at d for deterministic drafts (prompt lookup, Jacobi). The output is distributed as p."""

from __future__ import annotations

import torch

from tokenhaul.decoding.sampler import draw


def accept_greedy(targets: list[int], drafts: list[int]) -> list[int]:
    """targets: the argmax at each of the k+1 rows; returns the 1..k+1 tokens kept."""
    n = 0
    while n < len(drafts) and drafts[n] == targets[n]:
        n += 1
    return targets[:n + 1]


def accept_sampled(probs: torch.Tensor, starts: list[int], drafts: list[list[int]],
                   draft_probs: list[torch.Tensor | None], gens: list[torch.Generator | None]) -> list[list[int]]:
    """probs: [R, V] target distributions; request i owns rows starts[i] .. starts[i] + len(drafts[i]).
    draft_probs[i]: [len(drafts[i]), V] or None (one-hot). Returns the kept tokens per request."""
    dev = probs.device
    rows = [s + j for s, d in zip(starts, drafts) for j in range(len(d))]
    toks = [t for d in drafts for t in d]
    p_d = probs[torch.tensor(rows, dtype=torch.long, device=dev), torch.tensor(toks, dtype=torch.long, device=dev)]
    q_d = torch.ones_like(p_d)
    at = 0
    for d, q in zip(drafts, draft_probs):
        if q is not None and d:
            q_d[at:at + len(d)] = q[torch.arange(len(d)), torch.tensor(d)].to(dev)
        at += len(d)
    ratio = (p_d / q_d).tolist()
    kept: list[list[int]] = []
    final_rows: list[int] = []
    residual = torch.zeros(len(drafts), probs.shape[-1], device=dev)  # q at the rejected position
    at = 0
    for i, (d, q, g) in enumerate(zip(drafts, draft_probs, gens)):
        u = torch.rand(len(d), generator=g).tolist() if g is not None else torch.rand(len(d)).tolist()
        n = 0
        while n < len(d) and u[n] < ratio[at + n]:
            n += 1
        if n < len(d):  # rejected d[n]: draw from max(p - q, 0)
            if q is None:
                residual[i, d[n]] = probs[starts[i] + n, d[n]]
            else:
                residual[i] = q[n].to(dev)
        kept.append(d[:n])
        final_rows.append(starts[i] + n)
        at += len(d)
    target = probs[final_rows]
    final = (target - residual).clamp_(min=0)
    empty = final.sum(-1) <= 0  # p == q up to rounding: nothing left to correct, draw from p
    final[empty] = target[empty]
    u = torch.stack([torch.rand(1, generator=g)[0] if g is not None else torch.rand(1)[0] for g in gens])
    last = draw(final, u).tolist()
    return [k + [t] for k, t in zip(kept, last)]
