"""Draft-model speculation: a small model with the target's vocabulary proposes k tokens, one batched
forward per drafted position; the target verifies them all in one pass (decoding/rejection.py).

The draft's KV lives in its own cache addressed by the target's block ids (the same block tables,
copied together on copy-on-write), so allocation, forks and rollback are the KV manager's alone.
Per request the proposer remembers how many positions of its cache are valid; after a rejection it
is cut back to the target's computed tokens (the rollback in the draft cache).

A packed (int4) draft drafts cheaply, one row at a time, but its kernels scale like a loop of GEMVs with
the rows, so catching up a prompt would cost more than the target's own prefill. Given a dense copy of
the draft (`prefill_model`, same weights), steps of more than PREFILL_ROWS rows run through it, into the
same cache."""

from __future__ import annotations

import torch

from tokenhaul.decoding.sampler import SamplingBatch, adjust_logits, argmax, draw, probabilities, uniforms
from tokenhaul.engine.request import Request
from tokenhaul.engine.runner import ModelRunner
from tokenhaul.engine.scheduler import ScheduledChunk, SchedulerOutput
from tokenhaul.errors import ModelError
from tokenhaul.kv.cache import KVCache
from tokenhaul.models.registry import Model


def check_pair(target: Model, draft: Model) -> None:
    """Refuse a draft whose vocabulary differs from the target's (its tokens would mean other text)."""
    t, d = target.config.vocab_size, draft.config.vocab_size
    if t != d:
        raise ModelError(f"draft model has a vocabulary of {d} tokens, the target {t}: speculation needs "
                         f"the same tokenizer (e.g. qwen2.5-coder-0.5b drafting for qwen2.5-coder-1.5b)")


PREFILL_ROWS = 16  # above this many rows a dense bf16 GEMM beats the packed int4 kernel (MACHINE.md: M=8
# int4 11.5 ms vs bf16 19.7, M=32 42.6 vs 32.0)


class DraftModel:
    writes_kv = True

    def __init__(self, model: Model, kv: KVCache, device: str | torch.device,
                 prefill_model: Model | None = None) -> None:
        self.runner = ModelRunner(model, kv, device)
        self.prefill_runner = ModelRunner(prefill_model, kv, device) if prefill_model is not None else self.runner
        self.block_size = kv.block_size
        self._valid: dict[str, tuple[int, int]] = {}  # request id → (valid draft KV positions, preemptions)

    def propose(self, reqs: list[Request], ks: list[int]) -> list[torch.Tensor | None]:
        """Catch the draft cache up with each request's tokens, then draft k tokens autoregressively."""
        live: dict[str, tuple[Request, int]] = {}
        chunks = []
        for r, k in zip(reqs, ks):
            k = min(k, len(r.block_ids) * self.block_size - r.num_computed_tokens)  # slots reserved
            r.draft_token_ids = []
            if k <= 0:
                continue
            valid, preempts = self._valid.get(r.request_id, (0, r.num_preemptions))
            valid = min(valid, r.num_computed_tokens) if preempts == r.num_preemptions else 0
            live[r.request_id] = (r, k)
            chunks.append(ScheduledChunk(r, valid, r.num_tokens - valid, 0, 1))
        probs: dict[str, list[torch.Tensor]] = {rid: [] for rid in live}
        while chunks:
            runner = self.prefill_runner if sum(c.num_tokens for c in chunks) > PREFILL_ROWS else self.runner
            inp = runner.prepare(SchedulerOutput(chunks))
            logits = runner.forward(inp)
            rs = [c.request for c in inp.sample_chunks]
            batch = SamplingBatch.build(rs, logits.shape[-1], [r.draft_token_ids for r in rs])
            logits = adjust_logits(logits, batch)
            tokens = argmax(logits)
            rand = (~batch.greedy).nonzero()[:, 0].tolist()
            if rand:
                sub = batch.rows(rand)
                p = probabilities(logits[rand], sub)
                tokens[rand] = draw(p, uniforms(sub.reqs)).to(tokens.device)
                for j, i in enumerate(rand):
                    probs[rs[i].request_id].append(p[j])
            chunks = []
            for r, t in zip(rs, tokens.tolist()):
                r.draft_token_ids.append(t)
                n = len(r.draft_token_ids)
                if n < live[r.request_id][1]:
                    chunks.append(ScheduledChunk(r, r.num_tokens + n - 1, 1, 0, 1))
                else:
                    self._valid[r.request_id] = (r.num_tokens + n - 1, r.num_preemptions)
        return [torch.stack(probs[r.request_id]) if probs.get(r.request_id) else None for r in reqs]

    def observe(self, req: Request, drafts: list[int], targets: list[int], accepted: int) -> None:
        pass  # the valid prefix is cut to the target's computed tokens at the next propose

    def forget(self, request_id: str) -> None:
        self._valid.pop(request_id, None)
