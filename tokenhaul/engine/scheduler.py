"""Scheduler: continuous batching in tokens. Each step, running requests get their next tokens
(one per decode, a chunk per unfinished prefill), then waiting requests join under the token
budget. When blocks run out, the youngest running request is preempted (recompute) and resumed
later from the waiting queue. Token arithmetic only: KV goes through kv/manager.py; never imports a model."""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field

from tokenhaul.engine.request import Request, Status
from tokenhaul.errors import CapacityError, RequestError
from tokenhaul.kv.manager import KVManager


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_batched_tokens: int = 512
    max_num_seqs: int = 64
    max_model_len: int = 8192


@dataclass
class ScheduledChunk:
    request: Request
    start: int  # first position computed this step (== num_computed_tokens before the step)
    num_tokens: int
    num_drafts: int = 0  # draft tokens at the end of the chunk, verified this step
    num_sampled: int = 0  # last rows whose logits are sampled: 1 + num_drafts at the end of the known
    #                       tokens, 0 for a prompt chunk mid-way


def chunk(req: Request, num_tokens: int) -> ScheduledChunk:
    """The chunk computing req's next num_tokens positions (its drafts included when they all fit)."""
    drafts = len(req.draft_token_ids)
    reaches_end = req.num_computed_tokens + num_tokens == req.num_tokens + drafts
    return ScheduledChunk(req, req.num_computed_tokens, num_tokens, drafts, 1 + drafts if reaches_end else 0)


@dataclass
class SchedulerOutput:
    chunks: list[ScheduledChunk] = field(default_factory=list)
    preempted: list[str] = field(default_factory=list)
    block_copies: list[tuple[int, int]] = field(default_factory=list)  # (src, dst) copy-on-write

    @property
    def num_tokens(self) -> int:
        return sum(c.num_tokens for c in self.chunks)


class Scheduler:
    def __init__(self, config: SchedulerConfig, kv: KVManager) -> None:
        self.config = config
        self.kv = kv
        self.waiting: list[Request] = []  # sorted by (priority, arrival)
        self.running: list[Request] = []  # admission order: the last is the youngest
        self.requests: dict[str, Request] = {}
        self.num_preemptions = 0

    # admission ---------------------------------------------------------------------------
    def add(self, req: Request) -> None:
        """Queue a request, or raise RequestError / CapacityError if it can never be served."""
        n = req.num_prompt_tokens
        if n == 0:
            raise RequestError("prompt is empty")
        if req.request_id in self.requests:
            raise RequestError(f"duplicate request id {req.request_id!r}")
        if n >= self.config.max_model_len:
            raise RequestError(f"prompt has {n} tokens; the context holds {self.config.max_model_len} "
                               f"(prompt + at least 1 new token)")
        total = min(n + req.params.max_tokens, self.config.max_model_len)
        need = self.kv.blocks_for(total)
        if need > self.kv.num_blocks:
            raise CapacityError(f"request needs {need} KV blocks ({total} tokens) but the pool has only "
                                f"{self.kv.num_blocks}; raise --kv-memory or lower max_tokens")
        self.requests[req.request_id] = req
        self._enqueue(req)

    def abort(self, request_id: str, reason: str = "abort") -> Request | None:
        """Finish a request now and free its blocks at once. Returns it, or None if unknown/finished."""
        req = self.requests.get(request_id)
        if req is None:
            return None
        if req.status is Status.RUNNING:
            self.running.remove(req)
        elif req in self.waiting:
            self.waiting.remove(req)
        self._finish(req, reason)
        return req

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    # the step ----------------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        """Running requests first (their next tokens and drafts), then waiting ones, under the token
        budget. Drafts that do not fit the budget are dropped, not split."""
        out = SchedulerOutput()
        budget = self.config.max_num_batched_tokens
        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            if req.num_tokens_with_drafts - req.num_computed_tokens > budget:
                req.draft_token_ids = []
            n = min(req.num_tokens_with_drafts - req.num_computed_tokens, budget)
            if not self._reserve(req, n, out):
                break  # req itself was preempted
            out.chunks.append(chunk(req, n))
            budget -= n
            i += 1
        while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs and not out.preempted:
            req = self.waiting[0]
            computed = self.kv.match(req)
            if req.num_preemptions == 0:
                req.num_cached_tokens = computed
            n = min(req.num_tokens - computed, budget)
            copies = self.kv.allocate_slots(req, n, req.num_lookahead)
            if copies is None:
                self.kv.free(req)
                break
            out.block_copies += copies
            self.waiting.pop(0)
            req.status = Status.RUNNING
            self.running.append(req)
            out.chunks.append(chunk(req, n))
            budget -= n
        return out

    def update(self, out: SchedulerOutput, accepted: dict[str, list[int]]) -> list[Request]:
        """Advance each chunk's request by what was accepted: a chunk of n tokens ending in d drafts,
        of which a were accepted (then len(tokens) == a + 1), computed n - (d - a) positions; the
        accepted tokens are appended until one stops the request; rejected slots are rolled back.
        Returns the requests that finished."""
        finished = []
        for c in out.chunks:
            req = c.request
            if req.status is not Status.RUNNING:
                continue  # aborted during the step
            tokens = accepted.get(req.request_id, [])
            rejected = c.num_drafts - (len(tokens) - 1) if tokens else c.num_drafts
            req.num_computed_tokens += c.num_tokens - rejected
            req.draft_token_ids = []
            reason = None
            for tok in tokens:
                req.output_token_ids.append(tok)
                reason = self._stop_reason(req, tok)
                if reason is not None:
                    break
            if reason is not None:
                self.running.remove(req)
                self._finish(req, reason)
                finished.append(req)
                continue
            if rejected:
                self.kv.truncate(req, req.num_computed_tokens + req.num_lookahead)
            self.kv.commit(req)
        return finished

    # helpers -----------------------------------------------------------------------------
    def _stop_reason(self, req: Request, tok: int) -> str | None:
        p = req.params
        if not p.ignore_eos and tok in req.eos_token_ids:
            return "stop"
        if tok in p.stop_token_ids:
            return "stop"
        if len(req.output_token_ids) >= p.max_tokens or req.num_tokens >= self.config.max_model_len:
            return "length"
        return None

    def _reserve(self, req: Request, n: int, out: SchedulerOutput) -> bool:
        """Make slots for n more tokens (plus the request's lookahead) writable, preempting the
        youngest running requests if needed. Returns False if req itself had to be preempted."""
        while (copies := self.kv.allocate_slots(req, n, req.num_lookahead)) is None:
            victim = self.running[-1]
            self._preempt(victim, out)
            if victim is req:
                return False
        out.block_copies += copies
        return True

    def _preempt(self, req: Request, out: SchedulerOutput) -> None:
        self.running.remove(req)
        self.kv.free(req)
        req.draft_token_ids = []
        req.status = Status.WAITING
        req.num_preemptions += 1
        self.num_preemptions += 1
        out.preempted.append(req.request_id)
        self._enqueue(req)

    def _enqueue(self, req: Request) -> None:
        keys = [r.sort_key for r in self.waiting]
        self.waiting.insert(bisect.bisect(keys, req.sort_key), req)

    def _finish(self, req: Request, reason: str) -> None:
        self.kv.free(req)
        req.draft_token_ids = []
        req.status = Status.FINISHED
        req.finish_reason = reason
        self.requests.pop(req.request_id, None)
