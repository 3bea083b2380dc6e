"""Scheduler: continuous batching in tokens. Each step, running requests get their next tokens
(one per decode, a chunk per unfinished prefill), then waiting requests join under the token
budget. When blocks run out, the youngest running request is preempted (recompute) and resumed
later from the waiting queue. Works on integer block ids only; never imports a model."""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field

from tokenhaul.engine.request import Request, Status
from tokenhaul.errors import CapacityError, RequestError
from tokenhaul.kv.block_pool import BlockPool
from tokenhaul.kv.prefix_cache import PrefixCache


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

    @property
    def samples(self) -> bool:
        """True when this chunk reaches the end of the known tokens, so its last logits are sampled."""
        return self.start + self.num_tokens == self.request.num_tokens


@dataclass
class SchedulerOutput:
    chunks: list[ScheduledChunk] = field(default_factory=list)
    preempted: list[str] = field(default_factory=list)
    block_copies: list[tuple[int, int]] = field(default_factory=list)  # (src, dst) copy-on-write

    @property
    def num_tokens(self) -> int:
        return sum(c.num_tokens for c in self.chunks)


class Scheduler:
    def __init__(self, config: SchedulerConfig, pool: BlockPool, prefix_cache: PrefixCache) -> None:
        self.config = config
        self.pool = pool
        self.prefix_cache = prefix_cache
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
        need = self._blocks_for(total)
        if need > self.pool.num_blocks:
            raise CapacityError(f"request needs {need} KV blocks ({total} tokens) but the pool has only "
                                f"{self.pool.num_blocks}; raise --kv-memory or lower max_tokens")
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
        out = SchedulerOutput()
        budget = self.config.max_num_batched_tokens
        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            n = min(req.num_tokens - req.num_computed_tokens, budget)
            if not self._reserve(req, n, out):
                break  # req itself was preempted
            out.chunks.append(ScheduledChunk(req, req.num_computed_tokens, n))
            budget -= n
            i += 1
        while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs and not out.preempted:
            req = self.waiting[0]
            if not req.block_ids:
                req.block_ids, req.block_hashes = self.prefix_cache.match(req.all_token_ids)
                req.num_computed_tokens = len(req.block_ids) * self.pool.block_size
                if req.num_preemptions == 0:
                    req.num_cached_tokens = req.num_computed_tokens
            n = min(req.num_tokens - req.num_computed_tokens, budget)
            need = self._blocks_for(req.num_computed_tokens + n) - len(req.block_ids)
            if need > self.pool.num_free:
                self._release(req)
                break
            req.block_ids += self.pool.allocate(need)
            self.waiting.pop(0)
            req.status = Status.RUNNING
            self.running.append(req)
            out.chunks.append(ScheduledChunk(req, req.num_computed_tokens, n))
            budget -= n
        return out

    def update(self, out: SchedulerOutput, sampled: dict[str, int]) -> list[Request]:
        """Advance computed tokens, append sampled tokens, finish what stops. Returns finished."""
        finished = []
        for c in out.chunks:
            req = c.request
            if req.status is not Status.RUNNING:
                continue  # aborted during the step
            req.num_computed_tokens += c.num_tokens
            if self.prefix_cache.enabled and req.num_computed_tokens // self.pool.block_size > len(req.block_hashes):
                req.block_hashes = self.prefix_cache.register(
                    req.all_token_ids, req.num_computed_tokens, req.block_ids, req.block_hashes)
            tok = sampled.get(req.request_id)
            if tok is None:
                continue
            req.output_token_ids.append(tok)
            reason = self._stop_reason(req, tok)
            if reason is not None:
                self.running.remove(req)
                self._finish(req, reason)
                finished.append(req)
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

    def _blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.pool.block_size)

    def _reserve(self, req: Request, n: int, out: SchedulerOutput) -> bool:
        """Make sure req has blocks for n more tokens, preempting the youngest running requests
        if needed. Returns False if req itself had to be preempted."""
        need = self._blocks_for(req.num_computed_tokens + n) - len(req.block_ids)
        while need > self.pool.num_free:
            victim = self.running[-1]
            self._preempt(victim, out)
            if victim is req:
                return False
        if need > 0:
            req.block_ids += self.pool.allocate(need)
        last = req.num_computed_tokens // self.pool.block_size
        if last < len(req.block_ids) and req.num_computed_tokens % self.pool.block_size:
            b = req.block_ids[last]  # the partly filled block we are about to write into
            new = self.pool.copy_on_write(b)
            if new != b:
                out.block_copies.append((b, new))
                req.block_ids[last] = new
        return True

    def _preempt(self, req: Request, out: SchedulerOutput) -> None:
        self.running.remove(req)
        self._release(req)
        req.status = Status.WAITING
        req.num_preemptions += 1
        self.num_preemptions += 1
        out.preempted.append(req.request_id)
        self._enqueue(req)

    def _release(self, req: Request) -> None:
        self.pool.free(req.block_ids)
        req.block_ids, req.block_hashes, req.num_computed_tokens = [], [], 0

    def _enqueue(self, req: Request) -> None:
        keys = [r.sort_key for r in self.waiting]
        self.waiting.insert(bisect.bisect(keys, req.sort_key), req)

    def _finish(self, req: Request, reason: str) -> None:
        self._release(req)
        req.status = Status.FINISHED
        req.finish_reason = reason
        self.requests.pop(req.request_id, None)
