"""Ledger: the observer of every step and every delivered token. It records; it never steers.

Memory stays bounded for a long-running server: running totals per phase and stage, plus rings of
the most recent steps, token deliveries and finished requests (percentiles are over those rings).
Recording is a few dict and integer updates per step and per token (bench/ledger_overhead.py).
"""

from __future__ import annotations

import math
import time
from collections import OrderedDict, deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from tokenhaul.engine.core import StepRecord
from tokenhaul.engine.request import Request
from tokenhaul.host import openmp_wait
from tokenhaul.ledger.costs import ModelCosts, StepCosts, step_costs

if TYPE_CHECKING:  # the ledger is handed a roofline; it never imports whatif at run time
    from tokenhaul.whatif.roofline import Position, Roofline

ENGINE_STAGES = ("schedule", "prepare", "forward", "sample", "update", "propose")
FRONT_STAGES = ("detokenize", "deliver")
STAGES = ENGINE_STAGES + FRONT_STAGES


def computes_prompt(n: int, drafts: int, sampled: int) -> bool:
    """Whether a chunk of `n` positions, `drafts` of them speculative, computes prompt positions (or recomputes
    positions lost to preemption, as a prompt is computed): every chunk does but a decode, one new position of a
    request that has `sampled` before, whatever its length (a 1-token prompt, or a chunked prompt's 1-token
    last chunk, is prefill). The one rule for the ledger's phases and Perfetto's chunk names."""
    return not (n - drafts == 1 and sampled)


@dataclass(slots=True)
class StepEntry:
    record: StepRecord
    costs: StepCosts
    num_tokens: int  # tokens computed
    prompt_chunks: tuple[bool, ...]  # per chunk of record.chunks: computes_prompt, as on_step judged it
    recomputed: int  # tokens computed before, lost to preemption, computed again
    gap_before: float  # seconds since the previous busy step ended (front end, loop, observer)
    seconds: float  # sum of the engine stages
    detokenize_s: float = 0.0  # front-end time spent on this step's tokens
    deliver_s: float = 0.0

    @property
    def t_end(self) -> float:
        return self.record.t_start + self.seconds

    @property
    def num_sampled(self) -> int:
        return len(self.record.sampled)

    @property
    def is_prefill(self) -> bool:
        """Any chunk computes prompt positions (a decode verifying drafts does not)."""
        return any(self.prompt_chunks)


@dataclass(slots=True)
class TokenEvent:
    request_id: str
    step: int  # index of the step that produced it
    t: float  # perf_counter when the front end had delivered it
    detokenize_s: float
    deliver_s: float
    last_mile_s: float  # end of its step → delivered (-1 when the step is unknown)


@dataclass(slots=True)
class RequestSpan:
    request_id: str
    first_step_t: float  # start of the first step that computed any of its tokens
    arrival_t: float | None = None
    first_token_t: float | None = None
    last_token_t: float | None = None
    finish_t: float | None = None
    tokens: int = 0  # delivered
    sampled: int = 0  # produced by the engine
    computed: int = 0  # highest position computed so far
    recomputed: int = 0
    preemptions: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    finish_reason: str | None = None
    proposed: int = 0  # speculative draft tokens verified
    accepted: int = 0  # of which kept
    rejected_bytes: int = 0  # bytes moved only because of rejected drafts (marginal, from costs.py)
    rejected_s: float = 0.0  # forward time of rejected drafts (the step's, by their share of its tokens)

    @property
    def rejected(self) -> int:
        return self.proposed - self.accepted

    @property
    def ttft(self) -> float | None:
        start = self.arrival_t if self.arrival_t is not None else self.first_step_t
        return None if self.first_token_t is None else self.first_token_t - start


@dataclass
class Phase:
    """Running totals over the steps of one phase (prefill: any chunk computes prompt positions; decode: the rest)."""

    steps: int = 0
    tokens: int = 0  # computed
    sampled: int = 0
    seconds: float = 0.0  # engine stages
    forward_seconds: float = 0.0
    costs: StepCosts = field(default_factory=StepCosts)

    def position(self, roof: Roofline) -> Position:
        return roof.position(self.costs.dram_bytes, self.costs.flops, self.forward_seconds)


class Ledger:
    def __init__(self, costs: ModelCosts, max_steps: int = 1024, max_tokens: int = 16384,
                 max_requests: int = 1024, roofline: Callable[[], Roofline] | None = None) -> None:
        self.costs = costs
        self._roofline = roofline  # called when a reading needs this machine's limits and none is passed
        self.t0 = time.perf_counter()
        # how this process runs its ops: a step's time depends on the OpenMP wait policy as much as on a kernel
        self.host = {"threads": torch.get_num_threads(), "openmp_wait": openmp_wait()}
        self.steps: deque[StepEntry] = deque(maxlen=max_steps)
        self.tokens: deque[TokenEvent] = deque(maxlen=max_tokens)
        self.requests: deque[RequestSpan] = deque(maxlen=max_requests)  # finished
        self.itl: deque[float] = deque(maxlen=max_tokens)
        self.prefill = Phase()
        self.decode = Phase()
        self.stage_seconds: dict[str, float] = dict.fromkeys(STAGES, 0.0)
        self.gap_seconds = 0.0  # between busy steps, outside every engine stage
        self.num_steps = self.num_tokens = self.num_preemptions = 0
        self.recomputed_tokens = self.rejected_tokens = self.prompt_tokens = 0
        self.proposed_tokens = self.accepted_tokens = 0  # speculative drafts verified / kept
        self.rejected_bytes = 0
        self.rejected_seconds = 0.0
        self.kv_blocks_peak = 0
        self._live: dict[str, RequestSpan] = {}
        self._closing: OrderedDict[str, RequestSpan] = OrderedDict()  # finished, last tokens in flight
        self._last_end: float | None = None

    # observer interface (engine core) ------------------------------------------------------
    def on_step(self, record: StepRecord) -> None:
        live = self._live
        pairs = []
        tokens = prompt = recomputed = 0
        prompt_chunks = []
        drafts, rejected = {}, {}
        for rid, proposed, accepted in record.speculation:
            drafts[rid], rejected[rid] = proposed, proposed - accepted
            span = live.get(rid)
            if span is not None:
                span.proposed += proposed
                span.accepted += accepted
        for rid, start, n in record.chunks:
            pairs.append((start, n))
            tokens += n
            span = live.get(rid)
            if span is None:
                span = live[rid] = RequestSpan(rid, record.t_start)
            prompt_chunks.append(computes_prompt(n, drafts.get(rid, 0), span.sampled))
            end = start + n
            if start < span.computed:
                r = min(end, span.computed) - start
                recomputed += r
                span.recomputed += r
            elif prompt_chunks[-1]:
                prompt += n
            end -= rejected.get(rid, 0)  # rejected drafts' positions are computed again, not recomputed
            if end > span.computed:
                span.computed = end
        for rid in record.sampled:
            live[rid].sampled += 1
        for rid in record.preempted:
            span = live.get(rid)
            if span is not None:
                span.preemptions += 1  # its KV is gone; recompute shows as positions below `computed`
        logit_rows = len(set(record.sampled)) + sum(drafts.values())
        costs = step_costs(self.costs, pairs, logit_rows, record.kv_copy_tokens, record.kv_block_size,
                           record.kv_view_slots, record.attn_groups or None, record.prompt_logprob_rows)
        if record.rejected_tokens:
            self._charge_rejected(record, rejected, tokens, logit_rows, costs)
        seconds = 0.0
        stages = self.stage_seconds
        for k, v in record.stage_seconds.items():
            stages[k] = stages.get(k, 0.0) + v
            seconds += v
        gap = 0.0 if self._last_end is None else max(0.0, record.t_start - self._last_end)
        self.gap_seconds += gap
        phase = self.prefill if any(prompt_chunks) else self.decode
        phase.steps += 1
        phase.tokens += tokens
        phase.sampled += len(record.sampled)
        phase.seconds += seconds
        phase.forward_seconds += record.stage_seconds.get("forward", 0.0)
        phase.costs.add(costs)
        self.num_steps += 1
        self.num_preemptions += len(record.preempted)
        self.recomputed_tokens += recomputed
        self.prompt_tokens += prompt
        self.rejected_tokens += record.rejected_tokens
        for _, proposed, accepted in record.speculation:
            self.proposed_tokens += proposed
            self.accepted_tokens += accepted
        self.kv_blocks_peak = max(self.kv_blocks_peak, record.kv_blocks_used)
        self.steps.append(StepEntry(record, costs, tokens, tuple(prompt_chunks), recomputed, gap, seconds))
        # a gap counts only while requests are in flight (idle time of a server is not coordination)
        self._last_end = record.t_start + seconds if live else None

    def _charge_rejected(self, record: StepRecord, rejected: dict[str, int],
                         tokens: int, logit_rows: int, costs: StepCosts) -> None:
        """Bytes: this step's cost minus the cost of the same step without the rejected drafts;
        time: the forward's, by the rejected drafts' share of the step's tokens."""
        kept = [(start, n - rejected.get(rid, 0)) for (rid, start, n) in record.chunks]
        without = step_costs(self.costs, kept, logit_rows - record.rejected_tokens, record.kv_copy_tokens,
                             record.kv_block_size, record.kv_view_slots, prompt_logit_rows=record.prompt_logprob_rows)
        forward = record.stage_seconds.get("forward", 0.0)
        for rid, r in rejected.items():
            span = self._live.get(rid)
            if span is not None and r:
                b = (costs.total_bytes - without.total_bytes) * r // record.rejected_tokens
                span.rejected_bytes += b
                span.rejected_s += forward * r / tokens
                self.rejected_bytes += b
                self.rejected_seconds += forward * r / tokens

    def on_finish(self, request: Request) -> None:
        rid = request.request_id
        span = self._live.pop(rid, None) or RequestSpan(rid, time.perf_counter())
        span.finish_t = time.perf_counter()
        span.arrival_t = request.arrival_time
        span.prompt_tokens = request.num_prompt_tokens
        span.cached_tokens = request.num_cached_tokens
        span.preemptions = request.num_preemptions
        span.finish_reason = request.finish_reason
        self.requests.append(span)
        self._closing[rid] = span
        if len(self._closing) > 256:
            self._closing.popitem(last=False)
        if not self._live:
            self._last_end = None

    # front-end interface ----------------------------------------------------------------------
    def on_token(self, request_id: str, step: int, detokenize_s: float, deliver_s: float = 0.0) -> None:
        """One token delivered to its client: `detokenize_s` turning it into text, `deliver_s`
        handing it over (output bookkeeping, or the network write in a server)."""
        t = time.perf_counter()
        stages = self.stage_seconds
        stages["detokenize"] += detokenize_s
        stages["deliver"] += deliver_s
        last_mile = -1.0
        for i in range(1, min(len(self.steps), 8) + 1):  # a front end may lag the core by a step or two
            entry = self.steps[-i]
            if entry.record.index == step:
                entry.detokenize_s += detokenize_s
                entry.deliver_s += deliver_s
                last_mile = t - entry.t_end
                break
        self.tokens.append(TokenEvent(request_id, step, t, detokenize_s, deliver_s, last_mile))
        self.num_tokens += 1
        span = self._live.get(request_id) or self._closing.get(request_id)
        if span is None:  # long finished, or never seen by on_step: no request figures
            return
        if span.last_token_t is None:
            span.first_token_t = t
        else:
            self.itl.append(t - span.last_token_t)
        span.last_token_t = t
        span.tokens += 1

    # reading ----------------------------------------------------------------------------------
    def roofline(self) -> Roofline:
        """The limits this ledger was given a source for (LLM passes whatif's calibration), for a step's weights:
        read from the last-level cache where they fit the buffer calibrated there."""
        if self._roofline is None:
            raise ValueError("this ledger has no roofline source: pass a Roofline to the reading")
        return self._roofline().for_working_set(self.costs.weight_bytes_per_step)

    @property
    def between_steps_seconds(self) -> float:
        """Time between busy steps not spent in the front end: loop, observer, scheduling glue."""
        front = self.stage_seconds["detokenize"] + self.stage_seconds["deliver"]
        return max(0.0, self.gap_seconds - front)

    def summary(self, roofline: Roofline | None = None) -> dict:
        """The short form: throughput, bytes per token, seconds per stage, roofline position."""
        roof = roofline or self.roofline()
        p, d = self.prefill, self.decode
        pre, dec = p.position(roof), d.position(roof)
        main = dec if d.steps else pre
        per_tok = d.sampled or 1
        tok = list(self.tokens)
        ttft = [r.ttft for r in self.requests if r.ttft is not None]
        return {
            "steps": self.num_steps,
            "prompt_tokens": self.prompt_tokens,  # computed from prompts (recompute and prefix hits excluded)
            "generated_tokens": p.sampled + d.sampled,
            "decode_tokens": d.sampled,  # of which sampled in decode steps: the tokens decode_tokens_per_s counts
            "prefill_computed_tokens": p.tokens,  # every token of prefill steps: the tokens the rate divides
            "prefill_tokens_per_s": _rate(p.tokens, p.seconds),
            "decode_tokens_per_s": _rate(d.sampled, d.seconds),
            "weight_bytes_per_token": d.costs.weight_bytes / per_tok if d.sampled else 0.0,
            "kv_bytes_per_token": d.costs.kv_bytes / per_tok if d.sampled else 0.0,
            "bytes_per_token": {k: v / per_tok for k, v in d.costs.as_dict().items() if k != "flops"},
            "flops_per_token": d.costs.flops / per_tok,
            "decode_gb_per_s": dec.gb_per_s,
            "roofline_fraction": main.roofline_fraction,
            "data_wait_fraction": main.data_fraction,
            "prefill": pre.as_dict(),
            "decode": dec.as_dict(),
            "stage_seconds": dict(self.stage_seconds),
            "between_steps_seconds": self.between_steps_seconds,
            "itl_ms": _pcts(self.itl),
            "ttft_ms": _pcts(ttft),
            "detokenize_ms": _pcts([e.detokenize_s for e in tok]),
            "last_mile_ms": _pcts([e.last_mile_s for e in tok if e.last_mile_s >= 0]),
            "preemptions": self.num_preemptions,
            "recomputed_tokens": self.recomputed_tokens,
            "rejected_tokens": self.rejected_tokens,
            "proposed_tokens": self.proposed_tokens,
            "accepted_tokens": self.accepted_tokens,
            "rejected_bytes": self.rejected_bytes,
            "rejected_seconds": self.rejected_seconds,
            "kv_blocks_peak": self.kv_blocks_peak,
            "host": dict(self.host),
            "calibration": {"bandwidth_gb_per_s": roof.bandwidth / 1e9, "gflop_per_s": roof.peak_flops / 1e9,
                            "key": roof.key},
        }

    def short_line(self, roofline: Roofline | None = None) -> str:
        """One line: prompt tokens and the rate of prefill steps (with that rate's own count where those steps
        computed more: decodes beside a prompt chunk, recomputes); tokens generated and the rate of those sampled
        in decode steps (steps computing no prompt positions: each request's first token, and any sampled beside
        a prompt chunk, come from prefill steps); decode's bytes per token and roofline position, when there was a
        decode step."""
        s = self.summary(roofline)
        prompt, computed, rate = s["prompt_tokens"], s["prefill_computed_tokens"], s["prefill_tokens_per_s"]
        prefill = f"prefill {prompt} tok @ {rate:.0f} tok/s" if computed == prompt else (
            f"prefill {prompt} prompt tok ({computed} computed in prefill steps @ {rate:.0f} tok/s)")
        line = f"{prefill} | {s['generated_tokens']} tok generated"
        if not self.decode.steps:
            return line + ", no decode steps"
        return (f"{line}: {s['decode_tokens']} in decode steps @ {s['decode_tokens_per_s']:.1f} tok/s | "
                f"{s['weight_bytes_per_token'] / 1e6:.0f} MB weights + "
                f"{s['kv_bytes_per_token'] / 1e6:.2f} MB KV per token | "
                f"{s['decode_gb_per_s']:.1f} GB/s, {s['roofline_fraction']:.0%} of roofline, "
                f"waiting on data {s['data_wait_fraction']:.0%} of forward")


def percentile(values, q: float) -> float:
    """Nearest-rank percentile (q in [0, 100]); 0.0 for no values."""
    v = sorted(values)
    if not v:
        return 0.0
    return v[min(len(v) - 1, max(0, math.ceil(q / 100 * len(v)) - 1))]


def _pcts(values) -> dict[str, float]:
    v = list(values)
    return {"p50": percentile(v, 50) * 1e3, "p99": percentile(v, 99) * 1e3,
            "max": max(v, default=0.0) * 1e3, "n": len(v)}


def _rate(n: float, seconds: float) -> float:
    return n / seconds if seconds > 0 else 0.0
