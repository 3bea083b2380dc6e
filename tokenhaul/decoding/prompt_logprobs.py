"""Prompt logprobs (vLLM's `SamplingParams.prompt_logprobs`): each prompt token's logprob under the model given
the tokens before it, and the k most likely tokens there. Raw model logprobs (no temperature, no penalties), as
the sampler's for generated tokens. Full-vocabulary logits exist for ROWS positions at a time; only the returned
numbers are kept."""

from __future__ import annotations

from collections.abc import Callable

import torch

from tokenhaul.engine.messages import Sample
from tokenhaul.engine.scheduler import ScheduledChunk

ROWS = 128  # positions turned into logits at once: [ROWS, vocab] fp32 (77 MB at a 150k vocabulary)


def prompt_logprobs(compute_logits: Callable[[torch.Tensor], torch.Tensor], hidden: torch.Tensor,
                    targets: list[int], ks: list[int]) -> list[Sample]:
    """hidden [M, hidden]: row i predicts token targets[i]; returns its logprob, its rank and the ks[i] best
    (token, logprob) pairs there (None for k = 0), as `sampler.with_logprobs` does."""
    out = []
    for s in range(0, len(targets), ROWS):
        lp = torch.log_softmax(compute_logits(hidden[s:s + ROWS]), -1)  # [rows, vocab] fp32
        tgt = torch.tensor(targets[s:s + ROWS], dtype=torch.long, device=lp.device)
        chosen_t = lp.gather(1, tgt[:, None])
        ranks = (lp >= chosen_t).sum(-1).tolist()  # vLLM's rank: the tokens at least as likely, itself included
        chosen = chosen_t[:, 0].tolist()
        vals, ids = [], []
        if k_max := max(ks[s:s + ROWS]):
            top = torch.topk(lp, k_max)
            vals, ids = top.values.tolist(), top.indices.tolist()
        for j, (t, lp_t, k) in enumerate(zip(targets[s:s + ROWS], chosen, ks[s:s + ROWS])):
            out.append(Sample(t, lp_t, list(zip(ids[j][:k], vals[j][:k])) if k else None, ranks[j]))
    return out


def collect(compute_logits: Callable[[torch.Tensor], torch.Tensor], hidden: torch.Tensor,
            chunks: list[ScheduledChunk]) -> None:
    """Append the prompt logprobs of each chunk's `prompt_positions` (hidden [M, hidden]: their rows, chunk after
    chunk) to its request's `prompt_logprobs` (mutates the requests)."""
    targets, ks = [], []
    for c in chunks:
        p = c.request.prompt_token_ids
        targets += p[c.prompt_positions.start + 1:c.prompt_positions.stop + 1]
        ks += [c.request.params.prompt_logprobs] * len(c.prompt_positions)
    samples = prompt_logprobs(compute_logits, hidden, targets, ks)
    i = 0
    for c in chunks:
        n = len(c.prompt_positions)
        c.request.prompt_logprobs += samples[i:i + n]
        i += n
