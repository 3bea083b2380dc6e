"""The accept rule of speculative decoding: which of k draft tokens the target keeps.

Greedy: keep drafts while each equals the target's argmax, then add the target's own next token
(lossless: the output is plain greedy's). Sampled, a draft model's drafts: exact rejection sampling
(Leviathan et al. 2023): keep draft d with probability min(1, p(d) / q(d)), q the draft's distribution;
at the first rejection draw from norm(max(p - q, 0)); after k acceptances draw a bonus token from p.
Sampled, deterministic drafts (prompt lookup, Jacobi; q one-hot): the same rule, taken in the coupled form
that draws each row's token as plain sampling would and keeps drafts while they match (the same acceptance
p(d), and plain sampling's very tokens). Either way the output is distributed as p."""

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
    kept: list[list[int]] = [[] for _ in drafts]
    one_hot = [i for i, (d, q) in enumerate(zip(drafts, draft_probs)) if q is None or not d]
    modelled = [i for i, (d, q) in enumerate(zip(drafts, draft_probs)) if q is not None and d]
    if one_hot:
        got = _match_draws(probs, [starts[i] for i in one_hot], [drafts[i] for i in one_hot],
                           [gens[i] for i in one_hot])
        for i, toks in zip(one_hot, got):
            kept[i] = toks
    if modelled:
        got = _reject(probs, [starts[i] for i in modelled], [drafts[i] for i in modelled],
                      [draft_probs[i] for i in modelled], [gens[i] for i in modelled])
        for i, toks in zip(modelled, got):
            kept[i] = toks
    return kept


def _match_draws(probs: torch.Tensor, starts: list[int], drafts: list[list[int]],
                 gens: list[torch.Generator | None]) -> list[list[int]]:
    """Deterministic drafts (one-hot q): draw each row's token as plain sampling does (inverse CDF, one uniform
    per token from the request's generator) and keep the drafts while the draws equal them. Draft d is kept
    with probability p(d) and a mismatch is distributed as p without d, as in rejection sampling; but the
    tokens are the very ones plain sampling draws, so a seeded request's output does not depend on whether it
    drafted (speculation pauses, or stops above the engine's speculative_max_batch)."""
    rows: list[int] = []
    us, states = [], []
    for s, d, g in zip(starts, drafts, gens):
        rows += range(s, s + len(d) + 1)
        states.append(g.get_state() if g is not None and d else None)
        us.append(torch.rand(len(d) + 1, generator=g) if g is not None else torch.rand(len(d) + 1))
    tokens = draw(probs[rows], torch.cat(us)).tolist()
    kept, at = [], 0
    for d, g, state in zip(drafts, gens, states):
        row = tokens[at:at + len(d) + 1]
        n = 0
        while n < len(d) and row[n] == d[n]:
            n += 1
        kept.append(row[:n + 1])
        if state is not None and n < len(d):  # consume n + 1 uniforms, as plain sampling of n + 1 tokens
            g.set_state(state)
            torch.rand(n + 1, generator=g)
        at += len(d) + 1
    return kept


def _reject(probs: torch.Tensor, starts: list[int], drafts: list[list[int]], draft_probs: list[torch.Tensor],
            gens: list[torch.Generator | None]) -> list[list[int]]:
    """A draft model's drafts: keep d with probability min(1, p(d) / q(d)); at the first rejection draw from
    norm(max(p - q, 0)); after k acceptances a bonus token from p."""
    dev = probs.device
    rows = [s + j for s, d in zip(starts, drafts) for j in range(len(d))]
    toks = [t for d in drafts for t in d]
    p_d = probs[torch.tensor(rows, dtype=torch.long, device=dev), torch.tensor(toks, dtype=torch.long, device=dev)]
    q_d = torch.cat([q[torch.arange(len(d)), torch.tensor(d)].to(dev) for d, q in zip(drafts, draft_probs)])
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
