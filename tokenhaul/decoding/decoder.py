"""Decoder: what the engine core calls after each forward — verify (sample the target's rows and keep
the accepted tokens of every request) and propose (drafts for the next step, by each request's
strategy). A plain request is the case of zero drafts: one row, one sampled token.

Strategies are Proposers in a registry keyed by `SamplingParams.speculative`. k adapts per request
(+2 after a full acceptance, -1 otherwise, within [1, num_speculative_tokens], as HF's assisted
generation); when even one draft is rejected the request drafts nothing for PAUSE steps, so text the
strategy cannot guess costs little. Above `max_batch` running requests nothing is proposed, because
verification then costs real compute instead of riding on idle bandwidth (bench/decoding.py)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from tokenhaul.decoding.grammar import mask_logits
from tokenhaul.decoding.rejection import accept_greedy, accept_sampled
from tokenhaul.decoding.sampler import Sample, SamplingBatch, adjust_logits, argmax, probabilities, with_logprobs
from tokenhaul.engine.request import Request
from tokenhaul.engine.scheduler import ScheduledChunk


class Proposer(Protocol):
    """A drafting strategy. `propose` writes up to ks[i] tokens into reqs[i].draft_token_ids and returns
    each request's draft distributions [k, V] (None: deterministic drafts). `writes_kv`: it runs a
    model over the request's KV slots while proposing (the scheduler then reserves lookahead)."""

    writes_kv: bool

    def propose(self, reqs: list[Request], ks: list[int]) -> list[torch.Tensor | None]: ...

    def observe(self, req: Request, drafts: list[int], targets: list[int], accepted: int) -> None: ...

    def forget(self, request_id: str) -> None: ...


@dataclass
class Verdict:
    request: Request
    samples: list[Sample]  # the kept tokens, 1..k+1 of them
    proposed: int
    accepted: int  # drafts kept (len(samples) - 1)


PAUSE = 4  # steps without drafts after a k=1 draft is rejected


class Decoder:
    def __init__(self, proposers: dict[str, Proposer], max_model_len: int, max_batch: int = 8) -> None:
        self.proposers = proposers
        self.max_model_len = max_model_len
        self.max_batch = max_batch
        self._k: dict[str, int] = {}
        self._q: dict[str, torch.Tensor | None] = {}
        self._pause: dict[str, int] = {}

    def verify(self, logits: torch.Tensor, chunks: list[ScheduledChunk],
               top: torch.Tensor | None = None) -> list[Verdict]:
        """logits [R, V]: chunk after chunk, chunk.num_sampled rows each (its drafts, then the next); `top`:
        their argmax [R] where the step computed it. Structured outputs' rows are masked first: what follows, logprobs
        included, sees only their allowed tokens (as vLLM)."""
        if all(c.num_sampled == 1 and c.request.params.greedy and not c.request.params.adjusts_logits
               for c in chunks):  # the common step: one greedy token per request, nothing to build
            reqs = [c.request for c in chunks]
            samples = with_logprobs(logits, (argmax(logits) if top is None else top).tolist(), reqs)
            return [Verdict(r, [s], 0, 0) for r, s in zip(reqs, samples)]
        reqs, prefixes, starts, drafts = [], [], [], []
        for c in chunks:
            d = c.request.draft_token_ids[:c.num_drafts]
            starts.append(len(reqs))
            drafts.append(d)
            reqs += [c.request] * c.num_sampled
            prefixes += [d[:i] for i in range(c.num_sampled)]
        logits = mask_logits(logits, reqs)
        batch = SamplingBatch.build(reqs, logits.shape[-1], prefixes)
        logits_p = adjust_logits(logits, batch)
        targets = argmax(logits_p).tolist()
        kept = [accept_greedy(targets[s:s + len(d) + 1], d) for s, d in zip(starts, drafts)]
        rand = [i for i, c in enumerate(chunks) if not c.request.params.greedy]
        if rand:
            rows = [starts[i] + j for i in rand for j in range(len(drafts[i]) + 1)]
            sub_starts = [sum(len(drafts[i]) + 1 for i in rand[:n]) for n in range(len(rand))]
            probs = probabilities(logits_p[rows], batch.rows(rows))
            got = accept_sampled(probs, sub_starts, [drafts[i] for i in rand],
                                 [self._q.get(chunks[i].request.request_id) for i in rand],
                                 [chunks[i].request.generator for i in rand])
            for i, toks in zip(rand, got):
                kept[i] = toks
        verdicts = []
        for c, s, d, toks in zip(chunks, starts, drafts, kept):
            rows = list(range(s, s + len(toks)))
            samples = with_logprobs(logits[rows], toks, [c.request] * len(toks))
            verdicts.append(Verdict(c.request, samples, len(d), len(toks) - 1))
            if d:
                self._adapt(c.request, d, targets[s:s + len(d) + 1], len(toks) - 1)
        return verdicts

    def propose(self, running: list[Request]) -> None:
        """Draft tokens for the next step of every running request in decode whose strategy is on."""
        by_name: dict[str, list[Request]] = {}
        for r in running:
            name = r.params.speculative
            if name == "off" or len(running) > self.max_batch:
                r.num_lookahead = 0
                continue
            k = self._k.setdefault(r.request_id, r.params.num_speculative_tokens)
            r.num_lookahead = k if self.proposers[name].writes_kv else 0
            if self._pause.get(r.request_id, 0) > 0:
                self._pause[r.request_id] -= 1
            elif r.num_computed_tokens == r.num_tokens - 1:  # prompt done: drafts follow the last token
                by_name.setdefault(name, []).append(r)
        for name, reqs in by_name.items():
            ks = [min(self._k[r.request_id], self._room(r) - 1) for r in reqs]
            for r, q in zip(reqs, self.proposers[name].propose(reqs, ks)):
                self._q[r.request_id] = q
        for r in running:  # next step's tokens, drafts and lookahead within the slots admission counted
            r.num_lookahead = min(r.num_lookahead, self._room(r) - len(r.draft_token_ids))

    def _room(self, r: Request) -> int:
        """The tokens r may still produce (up to max_tokens, within the context): its slots end there."""
        return min(r.params.max_tokens - len(r.output_token_ids), self.max_model_len - r.num_tokens)

    def forget(self, req: Request) -> None:
        """Drop a finished or aborted request's strategy state."""
        self._k.pop(req.request_id, None)
        self._q.pop(req.request_id, None)
        self._pause.pop(req.request_id, None)
        if req.params.speculative != "off":
            self.proposers[req.params.speculative].forget(req.request_id)

    def _adapt(self, req: Request, drafts: list[int], targets: list[int], accepted: int) -> None:
        k = self._k.get(req.request_id, len(drafts))
        if accepted == 0 and len(drafts) == 1:
            self._pause[req.request_id] = PAUSE
        k = k + 2 if accepted == len(drafts) else k - 1
        self._k[req.request_id] = max(1, min(req.params.num_speculative_tokens, k))
        self.proposers[req.params.speculative].observe(req, drafts, targets, accepted)
