"""Sampler: logits → next token per request (greedy, temperature, top-k/p, min-p, penalties, seed,
logprobs). Logprobs are those of the model's raw distribution, as in vLLM."""

from __future__ import annotations

import torch

from tokenhaul.engine.messages import Sample
from tokenhaul.engine.request import Request


def apply_penalties(logits: torch.Tensor, req: Request) -> torch.Tensor:
    """Repetition penalty over prompt + output (HF/vLLM form); presence and frequency over output."""
    p = req.params
    if p.repetition_penalty != 1.0:
        seen = torch.tensor(sorted(set(req.prompt_token_ids) | set(req.output_token_ids)),
                            device=logits.device)
        vals = logits[seen]
        logits[seen] = torch.where(vals > 0, vals / p.repetition_penalty, vals * p.repetition_penalty)
    if (p.presence_penalty or p.frequency_penalty) and req.output_token_ids:
        out = torch.tensor(req.output_token_ids, device=logits.device)
        counts = torch.bincount(out, minlength=logits.shape[-1]).to(logits.dtype)
        logits -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0).to(logits.dtype)
    return logits


def filter_logits(logits: torch.Tensor, top_k: int, top_p: float, min_p: float) -> torch.Tensor:
    """Mask (to -inf) tokens outside top-k, outside the top-p nucleus, or below min_p × max prob."""
    if top_k and top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if min_p > 0:
        probs = torch.softmax(logits, -1)
        logits = logits.masked_fill(probs < min_p * probs.max(), float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True)
        cum = torch.softmax(sorted_logits, -1).cumsum(-1)
        drop = cum - torch.softmax(sorted_logits, -1) >= top_p  # keep the token that crosses top_p
        logits = logits.masked_fill(torch.zeros_like(drop).scatter(0, order, drop), float("-inf"))
    return logits


def sample_one(logits: torch.Tensor, req: Request) -> int:
    p = req.params
    if p.needs_penalties:
        logits = apply_penalties(logits.clone(), req)
    if p.greedy:
        return int(logits.argmax())
    logits = filter_logits(logits / p.temperature, p.top_k, p.top_p, p.min_p)
    probs = torch.softmax(logits, -1)
    if req.generator is not None:
        return int(torch.multinomial(probs.cpu(), 1, generator=req.generator))
    return int(torch.multinomial(probs, 1))


def sample(logits: torch.Tensor, reqs: list[Request]) -> list[Sample]:
    """logits: [N, vocab] fp32, one row per request in `reqs`."""
    simple = all(r.params.greedy and not r.params.needs_penalties for r in reqs)
    tokens = logits.argmax(-1).tolist() if simple else [sample_one(logits[i], r) for i, r in enumerate(reqs)]
    out = [Sample(t) for t in tokens]
    for i, r in enumerate(reqs):
        n = r.params.logprobs
        if n is None:
            continue
        lp = torch.log_softmax(logits[i], -1)
        out[i].logprob = float(lp[tokens[i]])
        if n > 0:
            vals, ids = torch.topk(lp, n)
            out[i].top_logprobs = list(zip(ids.tolist(), vals.tolist()))
    return out
