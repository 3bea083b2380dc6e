"""EngineCore: add_request / abort / step. Token ids in, token-id deltas out; no text, no HTTP.

step() is schedule → prepare → forward → verify → update → propose (decoding/decoder.py: a plain
request is one with no drafts). An optional observer (the ledger) is
told what each step did and how long each stage took; nothing here ever reads it back."""

from __future__ import annotations

import sys
import time
from collections.abc import Collection
from dataclasses import dataclass, field, replace
from typing import Protocol

import torch

from tokenhaul.config import EngineConfig
from tokenhaul.decoding import PROPOSERS
from tokenhaul.decoding.beam import BeamSearch
from tokenhaul.decoding.decoder import Decoder, Verdict
from tokenhaul.decoding.grammar import GrammarCompiler
from tokenhaul.decoding.prompt_logprobs import collect as collect_prompt_logprobs
from tokenhaul.decoding.speculative import DraftModel, check_pair
from tokenhaul.engine.compiled_decode import CompiledDecode
from tokenhaul.engine.detached_compile import compile_after_exit
from tokenhaul.engine.messages import CoreLimits, CoreStats, RequestDelta
from tokenhaul.engine.request import Request, Status
from tokenhaul.engine.runner import ModelRunner
from tokenhaul.engine.scheduler import Scheduler, SchedulerConfig
from tokenhaul.engine.step_calibration import load_or_calibrate
from tokenhaul.engine.step_time import StepTimeModel
from tokenhaul.errors import CapacityError, RequestError, TokenhaulError
from tokenhaul.kv.block_pool import BlockPool
from tokenhaul.kv.cache import KVCache
from tokenhaul.kv.manager import KVHolder, KVManager
from tokenhaul.kv.prefix_cache import PrefixCache
from tokenhaul.models.catalog import cache_root
from tokenhaul.models.registry import Model
from tokenhaul.sampling_params import SamplingParams


@dataclass
class StepRecord:
    """What one step did, for observers: timings per stage and the scheduled work."""

    index: int
    t_start: float
    stage_seconds: dict[str, float]
    chunks: list[tuple[str, int, int]]  # (request id, start position, tokens computed)
    sampled: list[str]  # request ids, one entry per token produced (a verified request may produce several)
    preempted: list[str]
    kv_blocks_used: int  # held through the step, finished requests' included (freed after it)
    kv_blocks_cached: int
    kv_copy_tokens: int = 0  # token slots duplicated by copy-on-write this step
    rejected_tokens: int = 0  # tokens computed then thrown away (rejected speculative drafts)
    kv_block_size: int = 1  # attention gathers K/V in whole blocks of this many slots
    kv_view_slots: int = 0  # key slots per layer read in place (consecutive blocks), not gathered
    speculation: list[tuple[str, int, int]] = field(default_factory=list)  # (request id, proposed, accepted)
    attn_groups: list[tuple[int, list[int]]] = field(default_factory=list)  # per attention call the runner made:
    # (query length, KV length of each sequence) — costs are computed from these, not from a copy of its rules
    budget_s: float = 0.0  # the inter-token budget the step was planned under (0: none)
    predicted_s: float = 0.0  # the step-time model's prediction for prepare + forward + sample
    prompt_logprob_rows: int = 0  # lm_head rows computed beyond the sampled ones: prompt positions' prompt logprobs


class StepObserver(Protocol):
    def on_step(self, record: StepRecord) -> None: ...

    def on_finish(self, request: Request) -> None: ...


def kv_blocks_for(config: EngineConfig, model: Model, draft: Model | None = None) -> int:
    def per_block(m: Model) -> int:
        c = m.config
        return KVCache.bytes_per_block(c.num_layers, config.block_size, c.num_kv_heads, c.head_dim,
                                       config.kv_torch_dtype)

    size = per_block(model) + (per_block(draft) if draft is not None else 0)
    return config.num_kv_blocks or max(1, int(config.kv_memory_gib * 2**30 // size))


def make_cache(config: EngineConfig, model: Model, num_blocks: int) -> KVCache:
    c = model.config
    return KVCache(c.num_layers, num_blocks, config.block_size, c.num_kv_heads, c.head_dim, config.kv_torch_dtype,
                   config.device)


class EngineCore:
    def __init__(self, config: EngineConfig, model: Model, observer: StepObserver | None = None,
                 draft_model: Model | None = None, step_time: StepTimeModel | None = None,
                 draft_prefill_model: Model | None = None, key_centers: torch.Tensor | None = None,
                 grammars: GrammarCompiler | None = None) -> None:
        """step_time: the model that sizes chunks under config.itl_target_ms (default: this machine's
        calibration, measured now if not cached). draft_prefill_model: a packed draft's dense copy, for its
        long catch-up steps (decoding/speculative.py). key_centers: [layers, Hkv, D] an int8 key cache subtracts
        (kv/key_centers.py; default zeros). grammars: builds structured outputs' matchers (default: from
        config.model's tokenizer, read on the first such request)."""
        self.config = config
        self.model = model
        self.grammars = grammars or GrammarCompiler.for_model(config.model, model.config.vocab_size)
        self.observer = observer
        num_blocks = kv_blocks_for(config, model, draft_model)
        self.kv = make_cache(config, model, num_blocks)
        if key_centers is not None:
            self.kv.set_key_centers(key_centers.to(self.kv.device))
        self.pool = BlockPool(num_blocks, config.block_size)
        self.prefix_cache = PrefixCache(self.pool, config.enable_prefix_caching)
        max_len = min(config.max_model_len, model.config.max_position)
        sched_cfg = SchedulerConfig(config.max_num_batched_tokens, config.max_num_seqs, max_len,
                                    config.itl_target_ms / 1e3)
        self.scheduler = Scheduler(sched_cfg, KVManager(self.pool, self.prefix_cache))
        proposers = {name: cls() for name, cls in PROPOSERS.items()}
        mirrors: tuple[KVCache, ...] = ()
        if draft_model is not None:
            check_pair(model, draft_model)
            mirrors = (make_cache(config, draft_model, num_blocks),)
            proposers["draft"] = DraftModel(draft_model, mirrors[0], config.device, draft_prefill_model)
        compiled = CompiledDecode(model, self.kv, config, cache_root()) if config.compiled_decode else None
        if compiled is not None and config.compile == "auto" and not compiled.cached:
            # this run stays eager; the next start loads the step compiled after it exits
            compile_after_exit(config, tuple(compiled.paths.values()))
            compiled = None
        self.runner = ModelRunner(model, self.kv, config.device, mirrors, config.deterministic, compiled)
        self.decoder = Decoder(proposers, max_len, config.speculative_max_batch)
        self.beams = BeamSearch(self.scheduler, max_len)
        self.num_steps = 0
        if config.itl_target_ms > 0:
            self.scheduler.step_time = step_time or load_or_calibrate(self)  # times the runner: built last
        if compiled is not None:
            self._compile(compiled)

    def _compile(self, compiled: CompiledDecode) -> None:
        """Compile the decode step now; a failure stops `--compile on` with one line, leaves `auto` eager."""
        try:
            compiled.warm_up()
        except Exception as e:  # noqa: BLE001 - any compiler failure
            msg = f"compiling the decode step failed ({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''})"
            if self.config.compile == "on":
                raise TokenhaulError(f"--compile on: {msg}") from None
            print(f"tokenhaul: {msg}; decoding eagerly", file=sys.stderr)
            self.runner.compiled = None

    @property
    def max_model_len(self) -> int:
        return self.scheduler.config.max_model_len

    def add_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                    eos_token_ids: tuple[int, ...] = (), priority: int = 0, *, fork_from: KVHolder | None = None,
                    keep_kv: KVHolder | None = None) -> None:
        """Queue a request; raises RequestError/CapacityError if it can never run. fork_from: start from
        the blocks held there, as far as its tokens match the prompt (copy-on-write); keep_kv: an empty
        holder that receives the request's blocks when it finishes (release it with `release`)."""
        if params.max_tokens is None:  # vLLM's None: up to the context's end
            params = replace(params, max_tokens=max(1, self.max_model_len - len(prompt_token_ids)))
        if params.n > 1 and not params.use_beam_search:
            raise RequestError(f"n={params.n} samples are fanned out by the front end (LLM.generate, the server): "
                               "the core takes one request per sample")
        params.check_served(self.decoder.proposers)
        self.limits().check_params(params)
        if params.use_beam_search:
            self.beams.add(request_id, list(prompt_token_ids), params, tuple(eos_token_ids), priority)
            return
        grammar = None if params.structured_outputs is None else self.grammars.compile(params.structured_outputs)
        req = Request(request_id, list(prompt_token_ids), params, tuple(eos_token_ids), priority, kv_heir=keep_kv,
                      grammar=grammar)
        self.scheduler.add(req)
        if fork_from is not None and not req.needs_prompt_logprobs:  # it computes every prompt position
            held = fork_from.token_ids[:min(fork_from.num_computed_tokens, len(req.prompt_token_ids) - 1)]
            n = next((i for i, (a, b) in enumerate(zip(held, req.prompt_token_ids)) if a != b), len(held))
            self.scheduler.kv.fork(fork_from, req, n)

    def release(self, holder: KVHolder) -> None:
        """Free the blocks a holder kept (add_request's keep_kv)."""
        self.scheduler.kv.free(holder)

    def abort(self, request_id: str, reason: str = "abort") -> None:
        """Finish a request now (client gone, stop string seen); its KV blocks are freed at once."""
        for beam in self.beams.abort(request_id):
            if self.observer:
                self.observer.on_finish(beam)
        req = self.scheduler.abort(request_id, reason)
        if req is not None:
            self.decoder.forget(req)
            if self.observer:
                self.observer.on_finish(req)

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    def limits(self) -> CoreLimits:
        """What a front end must check before admitting a request (fixed for the core's life)."""
        return CoreLimits(self.max_model_len, self.pool.block_size, self.pool.num_blocks, self.model.config.vocab_size,
                          tuple(self.decoder.proposers))

    def stats(self) -> CoreStats:
        """A snapshot of the batch, the KV pool and the counters (step_seconds: the caller times steps)."""
        s, p = self.scheduler, self.pool
        return CoreStats(len(s.running), len(s.waiting), p.num_used, p.num_cached, p.num_blocks,
                         self.prefix_cache.hit_tokens, self.prefix_cache.query_tokens, s.num_preemptions,
                         self.num_steps)

    def request_ids(self) -> list[str]:
        """Ids of the requests the core holds (waiting or running)."""
        return self.beams.public_ids(list(self.scheduler.requests))

    def step_only(self, request_ids: Collection[str]) -> list[RequestDelta]:
        """One step in which only these requests may be scheduled. The others are held out, keeping
        their state and blocks, and return to their places afterwards (to find which request makes
        a step fail, by stepping subsets of the batch)."""
        s, keep = self.scheduler, set(request_ids)
        running, waiting = s.running, s.waiting
        order = {r.request_id: i for i, r in enumerate(running)}
        s.running = [r for r in running if r.request_id in keep]
        s.waiting = [r for r in waiting if r.request_id in keep]
        try:
            return self.step()
        finally:
            held = [r for r in running if r.request_id not in keep]
            s.running = sorted(held + s.running, key=lambda r: order.get(r.request_id, len(order)))
            s.waiting = sorted([r for r in waiting if r.request_id not in keep] + s.waiting, key=lambda r: r.sort_key)

    def step(self) -> list[RequestDelta]:
        """schedule → prepare → forward → verify (sample; keep accepted drafts) → update → propose."""
        t0 = time.perf_counter()
        sched = self.scheduler.schedule()
        if not sched.chunks:
            if self.scheduler.waiting and not self.scheduler.running:
                raise CapacityError("no request can be scheduled: KV cache exhausted")
            return []
        t1 = time.perf_counter()
        inp = self.runner.prepare(sched)
        t2 = time.perf_counter()
        logits, top, prompt_hidden = self.runner.forward_with_argmax(inp)
        if logits.device.type == "cuda":
            torch.cuda.synchronize()
        t3 = time.perf_counter()
        if prompt_hidden is not None:
            collect_prompt_logprobs(self.model.compute_logits, prompt_hidden, inp.prompt_chunks)
        logits, chunks, beam_rows = self.beams.split(logits, inp.sample_chunks)
        top = top if chunks is inp.sample_chunks else None  # beams took rows out
        verdicts = self.decoder.verify(logits, chunks, top) if chunks else []
        t4 = time.perf_counter()
        self.scheduler.observe(sched, t4 - t1)
        before = {v.request.request_id: len(v.request.output_token_ids) for v in verdicts}
        blocks_used = self.pool.num_used  # held through the step (update frees finished requests' blocks)
        finished = self.scheduler.update(sched, {v.request.request_id: [s.token for s in v.samples]
                                                 for v in verdicts})
        for r in finished:
            self.decoder.forget(r)
        beam_deltas, beams_ended = self.beams.step(beam_rows)
        t5 = time.perf_counter()
        self.decoder.propose(self.scheduler.running)
        t6 = time.perf_counter()
        deltas = [self._delta(v, before[v.request.request_id]) for v in verdicts] + beam_deltas
        if self.observer:
            self.observer.on_step(StepRecord(
                self.num_steps, t0,
                {"schedule": t1 - t0, "prepare": t2 - t1, "forward": t3 - t2, "sample": t4 - t3,
                 "update": t5 - t4, "propose": t6 - t5},
                [(c.request.request_id, c.start, c.num_tokens) for c in sched.chunks],
                [d.request_id for d in deltas[:len(verdicts)] for _ in d.new_token_ids] + list(beam_rows),
                sched.preempted, blocks_used,
                self.pool.num_cached, len(sched.block_copies) * self.pool.block_size,
                rejected_tokens=sum(v.proposed - v.accepted for v in verdicts), kv_block_size=self.pool.block_size,
                kv_view_slots=inp.kv_view_slots,
                speculation=[(v.request.request_id, v.proposed, v.accepted) for v in verdicts if v.proposed],
                attn_groups=inp.attn_groups, budget_s=sched.budget_s, predicted_s=sched.predicted_s,
                prompt_logprob_rows=0 if inp.prompt_rows is None else len(inp.prompt_rows)))
            for r in finished + beams_ended:
                self.observer.on_finish(r)
        self.num_steps += 1
        return deltas

    @staticmethod
    def _delta(v: Verdict, before: int) -> RequestDelta:
        """The tokens update() appended for a verdict (a stop may cut the accepted ones short); the prompt
        logprobs with the first token."""
        req = v.request
        new = req.output_token_ids[before:]
        done = req.status is Status.FINISHED
        return RequestDelta(req.request_id, new, done, req.finish_reason if done else None, v.samples[:len(new)],
                            stop_reason=req.stop_reason if done else None,
                            prompt_logprobs=req.prompt_logprobs if before == 0 else None)
