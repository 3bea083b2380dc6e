"""Scheduler: continuous batching in tokens. Each step, running requests get their next tokens
(one per decode, a chunk per unfinished prefill), then waiting requests join under the token
budget. When blocks run out, the youngest running request is preempted (recompute) and resumed
later from the waiting queue. Token arithmetic only: KV goes through kv/manager.py; never imports a model.

With an inter-token budget (`itl_target_s` and a step-time model) the step is stall-free in the manner
of Sarathi-Serve: every running decode first, then prefill chunks in (priority, arrival) order, each
as long as keeps the predicted step within the budget. The budget is the target, or `decode_headroom`
times the predicted time of the decodes alone if that is more: prefill always gets a share of every
step in proportion to the decodes' (so a prompt is never starved however many decodes run), and no
step takes more than that factor of a decode-only step (the stream's gaps stay even). A step with
no decode has no one waiting for a token: its prefill fills the token cap."""

from __future__ import annotations

import bisect
import heapq
import math
from dataclasses import dataclass, field

from tokenhaul.engine.request import Request, Status
from tokenhaul.engine.step_time import StepShape, StepTimeModel
from tokenhaul.errors import CapacityError, RequestError
from tokenhaul.kv.manager import KVManager


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_batched_tokens: int = 512
    max_num_seqs: int = 64
    max_model_len: int = 8192
    itl_target_s: float = 0.0  # > 0 (with a step-time model): prefill chunks keep the predicted step under it
    min_prefill_chunk: int = 16  # tokens the first prefill chunk of a step gets however tight the budget
    decode_headroom: float = 1.5  # a step may take this many times its decodes' predicted time


@dataclass
class ScheduledChunk:
    request: Request
    start: int  # first position computed this step (== num_computed_tokens before the step)
    num_tokens: int
    num_drafts: int = 0  # draft tokens at the end of the chunk, verified this step
    num_sampled: int = 0  # last rows whose logits are sampled: 1 + num_drafts at the end of the known
    #                       tokens, 0 for a prompt chunk mid-way
    prompt_positions: range = range(0)  # positions whose logits give prompt logprobs (engine/request.py)


def chunk(req: Request, num_tokens: int) -> ScheduledChunk:
    """The chunk computing req's next num_tokens positions (its drafts included when they all fit)."""
    drafts = len(req.draft_token_ids)
    start = req.num_computed_tokens
    reaches_end = start + num_tokens == req.num_tokens + drafts
    return ScheduledChunk(req, start, num_tokens, drafts, 1 + drafts if reaches_end else 0,
                          req.prompt_logprob_positions(start, num_tokens))


@dataclass
class SchedulerOutput:
    chunks: list[ScheduledChunk] = field(default_factory=list)
    preempted: list[str] = field(default_factory=list)
    block_copies: list[tuple[int, int]] = field(default_factory=list)  # (src, dst) copy-on-write
    shape: StepShape | None = None  # with an inter-token budget: what the step-time model was asked
    budget_s: float = 0.0
    predicted_s: float = 0.0

    @property
    def num_tokens(self) -> int:
        return sum(c.num_tokens for c in self.chunks)


class Scheduler:
    def __init__(self, config: SchedulerConfig, kv: KVManager, step_time: StepTimeModel | None = None) -> None:
        self.config = config
        self.kv = kv
        self.step_time = step_time  # the scheduler's own estimate, refined by observe(), never by the ledger
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

    def adopt(self, req: Request) -> None:
        """Run a request that already holds (forked) KV blocks from the next step on, skipping the
        waiting queue: a new beam of a beam group (decoding/beam.py)."""
        self.requests[req.request_id] = req
        req.status = Status.RUNNING
        self.running.append(req)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    # the step ----------------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        """Running requests first (their next tokens and drafts), then waiting ones, under the token
        budget. Drafts that do not fit the budget are dropped, not split."""
        if self.step_time is not None and self.config.itl_target_s > 0:
            return self._schedule_within_budget()
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
        i = 0
        while i < len(self.waiting) and budget > 0 and len(self.running) < self.config.max_num_seqs \
                and not out.preempted:
            req = self.waiting[i]
            if not self._group_fits(req):
                break  # first come first served: no younger request takes the seats or blocks it waits for
            if self._prefix_in_flight(req, out):
                i += 1
                continue
            computed = self.kv.match(req, req.needs_prompt_logprobs)
            if req.num_preemptions == 0:
                req.num_cached_tokens = computed
            n = min(req.num_tokens - computed, budget)
            copies = self.kv.allocate_slots(req, n, req.num_lookahead)
            if copies is None:
                self.kv.free(req)
                break
            out.block_copies += copies
            self.waiting.pop(i)
            req.status = Status.RUNNING
            self.running.append(req)
            out.chunks.append(chunk(req, n))
            budget -= n
        return out

    def _schedule_within_budget(self) -> SchedulerOutput:
        """Every running decode (with its drafts if they fit the token cap), then prefill chunks, running
        and waiting merged in (priority, arrival) order, sized by the step-time model to the budget."""
        cfg, model = self.config, self.step_time
        assert model is not None
        out = SchedulerOutput(shape=StepShape(self.kv.block_size))
        tokens = cfg.max_num_batched_tokens
        for req in [r for r in self.running if r.num_computed_tokens >= r.num_tokens - 1]:
            if tokens <= 0:
                break
            if req.status is not Status.RUNNING:
                continue  # preempted for an older decode's blocks
            if req.num_tokens_with_drafts - req.num_computed_tokens > tokens:
                req.draft_token_ids = []
            if not self._reserve(req, req.num_tokens_with_drafts - req.num_computed_tokens, out):
                break  # req itself was preempted: every younger one already was
            self._add(out, chunk(req, req.num_tokens_with_drafts - req.num_computed_tokens))
            tokens -= out.chunks[-1].num_tokens
        partial = sorted((r for r in self.running if r.num_computed_tokens < r.num_tokens - 1), key=_key)
        decodes = model.predict(out.shape)
        out.budget_s = max(cfg.itl_target_s, cfg.decode_headroom * decodes) if out.chunks else 0.0  # 0: no bound
        limit = out.budget_s or math.inf
        admit = True
        first = True
        for req in heapq.merge(partial, list(self.waiting), key=_key):
            if tokens <= 0:
                break
            waiting = req.status is Status.WAITING
            if waiting and not (admit and not out.preempted and len(self.running) < cfg.max_num_seqs):
                continue
            if waiting and not self._group_fits(req):
                admit = False  # as when its blocks are short: no younger request is admitted past it
                continue
            if waiting and self._prefix_in_flight(req, out):
                continue
            if not waiting and req.status is not Status.RUNNING:
                continue
            start = self.kv.match(req, req.needs_prompt_logprobs) if waiting else req.num_computed_tokens
            if waiting and req.num_preemptions == 0:
                req.num_cached_tokens = start
            remaining = req.num_tokens - start
            n = model.max_chunk(out.shape, start, remaining, tokens, limit,
                                req.prompt_logprob_positions(start, remaining))
            if first:
                n = max(n, min(remaining, tokens, cfg.min_prefill_chunk))
            if n == 0:
                if waiting:
                    self.kv.free(req)
                break  # the budget is spent; no one behind may jump ahead
            if waiting:
                copies = self.kv.allocate_slots(req, n, req.num_lookahead)
                if copies is None:
                    self.kv.free(req)
                    admit = False  # first come first served: no younger request is admitted past it
                    continue
                out.block_copies += copies
                self.waiting.remove(req)
                req.status = Status.RUNNING
                self.running.append(req)
            elif not self._reserve(req, n, out):
                continue
            self._add(out, chunk(req, n))
            tokens -= n
            first = False
        out.predicted_s = model.predict(out.shape)
        return out

    def observe(self, out: SchedulerOutput, seconds: float) -> None:
        """The core measured a step this scheduler planned: refine the step-time model (mutates it)."""
        if self.step_time is not None and out.shape is not None:
            self.step_time.observe(out.shape, seconds)

    @staticmethod
    def _add(out: SchedulerOutput, c: ScheduledChunk) -> None:
        out.chunks.append(c)
        out.shape.add(c.start, c.num_tokens, c.num_sampled + len(c.prompt_positions))  # every lm_head row

    def update(self, out: SchedulerOutput, accepted: dict[str, list[int]]) -> list[Request]:
        """Advance each chunk's request by what was accepted: a chunk of n tokens ending in d drafts,
        of which a were accepted (then len(tokens) == a + 1), computed n - (d - a) positions; the
        accepted tokens are appended until one stops the request; rejected slots are rolled back, and so
        are the accepted ones past a stop (their KV is not the finished request's: it must neither count
        as computed nor reach the prefix cache). Returns the requests that finished."""
        finished = []
        for c in out.chunks:
            req = c.request
            if req.status is not Status.RUNNING:
                continue  # aborted during the step
            tokens = accepted.get(req.request_id, [])
            rejected = c.num_drafts - (len(tokens) - 1) if tokens else c.num_drafts
            req.num_computed_tokens += c.num_tokens - rejected
            req.draft_token_ids = []
            reason, kept = None, 0
            for tok in tokens:
                kept += 1
                req.output_token_ids.append(tok)
                if req.grammar is not None:
                    req.grammar.accept(tok)
                reason = self._stop_reason(req, tok)
                if reason is not None:
                    break
            if reason is not None:
                if kept < len(tokens):  # accepted drafts past the stop: as if rejected
                    req.num_computed_tokens -= len(tokens) - kept
                    self.kv.truncate(req, req.num_computed_tokens)
                self.kv.commit(req)  # its computed blocks serve later prompts, also when it ends at its prefill
                self.running.remove(req)
                self._finish(req, reason)
                finished.append(req)
                continue
            if rejected:
                self.kv.truncate(req, req.num_computed_tokens + req.num_lookahead)
            self.kv.commit(req)
        return finished

    # helpers -----------------------------------------------------------------------------
    def _group_fits(self, req: Request) -> bool:
        """A beam search's first beam is admitted only with room for its whole group beside the groups already
        admitted (their beams count whether running or preempted): `beam_width` seats under max_num_seqs (beams
        are adopted without asking) and its worst-case blocks in the pool. Otherwise a preempted beam could find
        the seats or blocks it needs held by beams of groups that wait for their own preempted siblings, and no
        group would step again. Preempted beams come back as any request."""
        if req.beam_group is None or req.num_preemptions or req.output_token_ids:
            return True
        groups = {r.beam_group: r for r in (*self.running, *self.waiting) if r.beam_group is not None
                  and (r.status is Status.RUNNING or r.num_preemptions or r.output_token_ids)}
        seats = sum(r.params.beam_width for r in groups.values()) + sum(r.beam_group is None for r in self.running)
        blocks = sum(self._group_blocks(r) for r in (*groups.values(), req))
        return seats + req.params.beam_width <= self.config.max_num_seqs and blocks <= self.kv.num_blocks

    def _group_blocks(self, req: Request) -> int:
        """The most blocks a beam group may hold at once (every beam's own tail, the prompt's full blocks shared)."""
        total = min(req.num_prompt_tokens + req.params.max_tokens, self.config.max_model_len)
        return self.kv.blocks_for_beams(req.num_prompt_tokens, total, req.params.beam_width)

    def _prefix_in_flight(self, req: Request, out: SchedulerOutput) -> bool:
        """Whether a chunk of this step completes a full block of `req`'s prompt prefix (same tokens up to and
        through that block): then `req` waits a step and takes those blocks from the prefix cache instead of
        computing them beside it (n samples of one prompt, a shared system prompt arriving together; SGLang
        holds such requests back too)."""
        if not self.kv.prefix_cache.enabled or req.needs_prompt_logprobs:
            return False
        bs, n = self.kv.block_size, req.num_tokens
        for c in out.chunks:
            end = (c.start // bs + 1) * bs  # the first block this chunk fills ends here
            other = c.request
            if end <= min(c.start + c.num_tokens, other.num_tokens, n - 1) \
                    and req.token_slice(end - 1, end) == other.token_slice(end - 1, end) \
                    and req.token_slice(0, end) == other.token_slice(0, end):  # cheap test first
                return True
        return False

    def _stop_reason(self, req: Request, tok: int) -> str | None:
        p = req.params
        if req.grammar is not None and req.grammar.failed:  # not "stop": the output breaks its constraint
            return "abort"
        if not p.ignore_eos and tok in req.eos_token_ids:
            return "stop"
        if tok in p.stop_token_ids:
            req.stop_reason = tok
            return "stop"
        if req.grammar is not None and req.grammar.complete:
            return "stop"
        if len(req.output_token_ids) >= p.max_tokens or req.num_tokens >= self.config.max_model_len:
            return "length"
        return None

    def _reserve(self, req: Request, n: int, out: SchedulerOutput) -> bool:
        """Make slots for n more tokens (plus the request's lookahead) writable, preempting the
        youngest running requests not yet scheduled this step if needed. Returns False if req itself
        had to be preempted."""
        while (copies := self.kv.allocate_slots(req, n, req.num_lookahead)) is None:
            scheduled = {id(c.request) for c in out.chunks}
            victim = next(r for r in reversed(self.running) if r is req or id(r) not in scheduled)
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
        if req.kv_heir is not None:
            req.kv_heir.token_ids = req.all_token_ids
            self.kv.fork(req, req.kv_heir)
        self.kv.free(req)
        req.draft_token_ids = []
        req.status = Status.FINISHED
        req.finish_reason = reason
        self.requests.pop(req.request_id, None)


def _key(req: Request) -> tuple[int, int]:
    return req.sort_key
