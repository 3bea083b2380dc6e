"""AsyncEngine: the server's front end to the engine core (vLLM v1 style).

    HTTP handler ──add_request(prompt ids, params)──► EngineClient ──► EngineCore.step() loop(s)
         ▲                                                                       │ token-id deltas
         └── RequestStream ◄── detokenize + stop strings (OutputProcessor) ◄─────┘ (event loop)

The EngineClient (engine/client.py) runs the core in a thread here or as Ray actors elsewhere; this
front end cannot tell which. Everything here runs on the asyncio event loop. Tokenization,
incremental detokenization and stop-string checks happen here, so they never block a step; the
core sees token ids only. A stream whose reader goes away aborts its requests, which frees their
KV blocks in the core at its next loop turn."""

from __future__ import annotations

import asyncio
import copy
import itertools
import logging
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from tokenhaul.engine.client import EngineClient, InProcessClient
from tokenhaul.engine.messages import AddRequest, CoreOutputs
from tokenhaul.errors import CapacityError, RequestError, TokenhaulError
from tokenhaul.outputs import BeamOutput, TokenLogprob
from tokenhaul.sampling_params import SamplingParams
from tokenhaul.server.metrics import ServerMetrics
from tokenhaul.text.output_processor import OutputProcessor
from tokenhaul.text.tokenizer import Tokenizer

log = logging.getLogger("tokenhaul.server")


class PromptTooLong(RequestError):
    """The prompt leaves no room for a new token in the model's context."""


class EngineOverloaded(TokenhaulError):
    """The waiting queue is full; the client should retry later (HTTP 429)."""


class EngineUnavailable(TokenhaulError):
    """The engine is not running: not started, shutting down, or its thread died (HTTP 503)."""


class EngineFailed(TokenhaulError):
    """The core could not serve an admitted request (a failed step); the message says why."""


@dataclass
class GenerationDelta:
    """What one request produced since the reader last looked: text and the token ids behind it."""

    text: str
    token_ids: list[int]
    logprobs: list[TokenLogprob] | None
    num_prompt_tokens: int
    num_output_tokens: int  # so far, in all
    finished: bool = False
    finish_reason: str | None = None
    stop_reason: int | str | None = None  # the stop string matched, or the stop token id
    # asked for: one per prompt token (None for the first), in the request's first delta only
    prompt_logprobs: list[TokenLogprob | None] | None = None

    def merge(self, later: GenerationDelta) -> None:
        """Append a later delta of the same request (the reader was slower than the engine)."""
        self.prompt_logprobs = self.prompt_logprobs or later.prompt_logprobs
        self.text += later.text
        self.token_ids += later.token_ids
        if self.logprobs is not None and later.logprobs is not None:
            self.logprobs += later.logprobs
        self.num_output_tokens = later.num_output_tokens
        self.finished, self.finish_reason, self.stop_reason = later.finished, later.finish_reason, later.stop_reason


class RequestStream:
    """The deltas of one API call's engine requests, coalesced while the reader is busy. Request i
    makes choices i*n .. i*n+n-1 (n > 1: a beam search's n best beams, all in its final delta). Each
    item is a list of (choice index, delta) in index order; iteration ends when every request has
    finished. Leaving `async with` early (or `abort()`) aborts what is unfinished."""

    def __init__(self, engine: AsyncEngine, request_ids: list[str], n: int = 1) -> None:
        self.request_ids = request_ids
        self.replicas: list[str] = []  # where its requests run, retries followed (the x-tokenhaul-replica header)
        self._engine = engine
        self._n = n
        self._pending: dict[int, GenerationDelta] = {}
        self._unfinished = set(range(len(request_ids)))
        self._error: Exception | None = None
        self._event = asyncio.Event()

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> list[tuple[int, GenerationDelta]]:
        while not self._pending and self._error is None:
            if not self._unfinished:
                raise StopAsyncIteration
            await self._event.wait()
            self._event.clear()
        if self._error is not None:
            raise self._error
        items = sorted(self._pending.items())
        self._pending.clear()
        return items

    async def started(self) -> None:
        """Wait, consuming nothing, until the stream has output, an error or its end: a request that streamed
        is not retried elsewhere (cluster/pool.py), so `replica` is final for it then."""
        while not self._pending and self._error is None and self._unfinished:
            await self._event.wait()
            self._event.clear()

    async def __aenter__(self) -> RequestStream:
        return self

    async def __aexit__(self, *exc: object) -> None:
        self.abort()

    @property
    def finished(self) -> bool:
        return not self._unfinished

    @property
    def replica(self) -> str:
        """The replica(s) serving this call, comma-separated (one, unless its choices were split)."""
        return ",".join(dict.fromkeys(self.replicas))

    def abort(self) -> None:
        """Abort the unfinished requests (idempotent); their KV blocks are freed by the core."""
        for i in sorted(self._unfinished):
            self._engine.abort(self.request_ids[i])
        self._unfinished.clear()

    # called by the engine, on the event loop ------------------------------------------------
    def _put(self, index: int, delta: GenerationDelta, beams: list[GenerationDelta] | None = None) -> None:
        """Request `index`'s delta for its first choice; `beams`, those of its other choices. A finished delta
        without them (an abort) finishes the other choices alike."""
        if beams is None:
            beams = [copy.deepcopy(delta) for _ in range(self._n - 1)] if delta.finished else []
        for k, d in enumerate([delta, *beams]):
            i = index * self._n + k
            if i in self._pending:
                self._pending[i].merge(d)
            else:
                self._pending[i] = d
        if delta.finished:
            self._unfinished.discard(index)
        self._event.set()

    def _fail(self, index: int, error: Exception) -> None:
        self._unfinished.discard(index)
        if self._error is None:
            self._error = error
        self._event.set()


@dataclass
class _Entry:
    """Front-end state of one engine request."""

    stream: RequestStream
    index: int
    num_prompt_tokens: int
    params: SamplingParams
    arrival: float = field(default_factory=time.perf_counter)
    deadline: asyncio.TimerHandle | None = None  # the generation deadline's timer, if any
    first_t: float | None = None
    last_t: float = 0.0
    num_seen: int = 0  # output tokens already handed to the stream


class _LastMileProbe:
    """Plugs into OutputProcessor's ledger slot: per-delta detokenize + stop-check seconds."""

    def __init__(self, metrics: ServerMetrics) -> None:
        self._hist = metrics.last_mile.labels("detokenize")

    def on_token(self, request_id: str, step: int, detokenize_s: float, deliver_s: float = 0.0) -> None:
        self._hist.observe(detokenize_s)


class AsyncEngine:
    """Front end: prompts in, RequestStreams out. Create, `await start()` on the serving event loop
    (it binds to that loop), `await shutdown()` at the end."""

    def __init__(self, client: EngineClient, tokenizer: Tokenizer, model_name: str, max_waiting: int = 256,
                 max_prompt_chars: int | None = None, request_timeout: float | None = None) -> None:
        """`client`: an EngineClient, or an EngineCore to step in a thread of this process."""
        self.tokenizer = tokenizer
        self.model_name = model_name
        self.max_waiting = max_waiting
        self.request_timeout = request_timeout  # seconds from admission; then finish_reason "abort"
        self.client = client if isinstance(client, EngineClient) else InProcessClient(client)
        self.limits = self.client.limits
        # text longer than this is refused before tokenizing (a token rarely spans more than ~16 characters)
        self.max_prompt_chars = max_prompt_chars or 32 * self.limits.max_model_len
        self.metrics = ServerMetrics(self.client.replicas, self.client.routing)
        self.processor = OutputProcessor(tokenizer, _LastMileProbe(self.metrics))
        self.created = int(time.time())
        self._eos = tuple(tokenizer.eos_token_ids)
        self._entries: dict[str, _Entry] = {}
        self._num_waiting = 0  # admitted requests without a first token yet
        self._loop: asyncio.AbstractEventLoop | None = None
        self._closing = False
        self._draining = False
        self._empty: asyncio.Event | None = None  # set while no request is unfinished
        self._ids = itertools.count()

    @classmethod
    def from_model(cls, model: str, served_model_name: str | None = None, max_waiting: int = 256,
                   max_prompt_chars: int | None = None, request_timeout: float | None = None,
                   **engine_kwargs) -> AsyncEngine:
        """Load a catalog model (or GGUF path) exactly as LLM does, and take over its core."""
        from tokenhaul.ledger.core_ledger import CoreLedger
        from tokenhaul.llm import LLM

        llm = LLM(model, **engine_kwargs)
        llm.prepare_structured_outputs()  # not inside the first constrained request's step
        return cls(InProcessClient(llm.core, CoreLedger(llm.costs)), llm.tokenizer, served_model_name or model,
                   max_waiting, max_prompt_chars, request_timeout)

    @classmethod
    def from_client(cls, client: EngineClient, model: str, served_model_name: str | None = None,
                    max_waiting: int = 256, max_prompt_chars: int | None = None,
                    request_timeout: float | None = None) -> AsyncEngine:
        """A front end over cores that run elsewhere (e.g. Ray replicas): loads the tokenizer only."""
        from tokenhaul.models.catalog import resolve

        f = resolve(model)
        return cls(client, Tokenizer.from_gguf(f.gguf_path, f.cache_dir, f.name), served_model_name or model,
                   max_waiting, max_prompt_chars, request_timeout)

    # lifecycle -----------------------------------------------------------------------------
    async def start(self, start_core: bool = True) -> None:
        """Bind to the running event loop and start the client; an in-process core steps in its own
        thread, unless the caller runs it (`client.run()`) in a thread of its own choosing."""
        self._loop = asyncio.get_running_loop()
        self._empty = asyncio.Event()
        self._empty.set()
        self.client.on_moved = self._moved
        await self.client.start(self._process, start_core)

    async def shutdown(self) -> None:
        self._closing = True
        self._fail_all(EngineUnavailable("the server is shutting down"))
        await asyncio.to_thread(self.client.close)

    async def drain(self, timeout: float) -> bool:
        """Stop admitting (new requests and /health get 503) and wait up to `timeout` seconds for the
        unfinished requests to finish; those still running then fail. True if all finished."""
        self._draining = True
        assert self._empty is not None, "start() first"
        try:
            await asyncio.wait_for(self._empty.wait(), timeout)
            return True
        except TimeoutError:
            self._fail_all(EngineUnavailable(f"the server is shutting down (not finished within {timeout:g} s)"))
            return False

    @property
    def healthy(self) -> bool:
        return self._loop is not None and self.client.alive and not (self._closing or self._draining)

    @property
    def loop(self) -> asyncio.AbstractEventLoop | None:
        """The event loop the engine serves on (None before start())."""
        return self._loop

    @property
    def num_waiting(self) -> int:
        return self._num_waiting

    @property
    def num_unfinished(self) -> int:
        return len(self._entries)

    # prompts -------------------------------------------------------------------------------
    def check_chars(self, num_chars: int) -> None:
        """Refuse prompt text too long for the context before spending time to tokenize it."""
        if num_chars > self.max_prompt_chars:
            raise PromptTooLong(f"prompt has {num_chars} characters; at most {self.max_prompt_chars} are tokenized "
                                f"(the model's context holds {self.limits.max_model_len} tokens)")

    async def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Tokenize off the event loop (a long text must not stall other requests)."""
        self.check_chars(len(text))
        return await asyncio.to_thread(self.tokenizer.encode, text, add_special_tokens)

    async def encode_chat(self, messages: list[dict], add_generation_prompt: bool = True,
                          continue_final_message: bool = False, add_special_tokens: bool = False,
                          template_kwargs: dict[str, Any] | None = None) -> list[int]:
        """Render the model's chat template (by default with the generation prompt; template_kwargs: more
        variables for it) and tokenize it, off the event loop; the template adds the special tokens it wants,
        add_special_tokens the tokenizer's on top."""
        self.check_chars(sum(len(m.get("content") or "") for m in messages))

        def render() -> list[int]:
            text = self.tokenizer.apply_chat_template(messages, add_generation_prompt, continue_final_message,
                                                      template_kwargs)
            self.check_chars(len(text) // 2)  # the template adds markup, never this much
            return self.tokenizer.encode(text, add_special_tokens=add_special_tokens)

        return await asyncio.to_thread(render)

    def check_prompt(self, prompt_ids: list[int], params: SamplingParams) -> None:
        """What the core's scheduler would refuse at admission, refused here first (as HTTP 400)."""
        lim = self.limits
        n = len(prompt_ids)
        if n == 0:
            raise RequestError("prompt is empty")
        params.check_served(lim.speculative)
        lim.check_params(params)
        if n >= lim.max_model_len:
            raise PromptTooLong(f"prompt has {n} tokens, but the model's context holds {lim.max_model_len} "
                                f"(prompt + at least 1 new token)")
        total = n + (params.max_tokens if params.max_tokens is not None else lim.max_model_len - n)
        if total > lim.max_model_len:  # as OpenAI and vLLM: refused, not cut short at the context's end
            raise PromptTooLong(f"prompt has {n} tokens and max_tokens is {params.max_tokens}: {total} tokens, but "
                                f"the model's context holds {lim.max_model_len}; lower max_tokens to at most "
                                f"{lim.max_model_len - n}")
        need = -(-total // lim.block_size)
        if need > lim.num_blocks:
            raise CapacityError(f"request needs {need} KV blocks ({total} tokens) but the pool has "
                                f"{lim.num_blocks}; lower max_tokens")

    # requests ------------------------------------------------------------------------------
    def add_request(self, prompts: list[list[int]], params: list[SamplingParams], prefix: str = "req") -> RequestStream:
        """Admit len(prompts) engine requests as one stream (request i = prompts[i], params[i]; all params share n,
        the choices per request). Raises RequestError (bad prompt), EngineOverloaded or EngineUnavailable; admits
        all or none."""
        if not self.healthy:
            stopping = self._closing or self._draining
            raise EngineUnavailable("the server is shutting down" if stopping else "the engine is not running")
        for ids, p in zip(prompts, params, strict=True):
            self.check_prompt(ids, p)
        n = params[0].n if params else 1
        if any(p.n != n for p in params):
            raise RequestError("the requests of one stream must share n")
        if len(prompts) > self.max_waiting:  # never admitted: no retry helps
            raise RequestError(f"the call makes {len(prompts)} engine requests (prompts × n), more than the server's "
                               f"waiting queue holds ({self.max_waiting}, --max-waiting); send fewer choices per call")
        if self._num_waiting + len(prompts) > self.max_waiting:
            raise EngineOverloaded(f"server overloaded: {self._num_waiting} requests are waiting for their first "
                                   f"token (limit {self.max_waiting}); retry later")
        ids = [f"{prefix}-{next(self._ids)}" for _ in prompts]
        stream = RequestStream(self, ids, n)
        assert self._loop is not None and self._empty is not None
        self._empty.clear()
        for i, (rid, prompt, p) in enumerate(zip(ids, prompts, params)):
            e = self._entries[rid] = _Entry(stream, i, len(prompt), p)
            if self.request_timeout is not None:
                e.deadline = self._loop.call_later(self.request_timeout, self._expire, rid)
            self._num_waiting += 1
            self.processor.add(rid, prompt, p)
            self.metrics.prompt_tokens.inc(len(prompt))
            stream.replicas.append(self.client.add(AddRequest(rid, list(prompt), p, self._eos)))
        return stream

    async def generate(self, request_id: str, prompt_ids: list[int],
                       params: SamplingParams) -> AsyncIterator[GenerationDelta]:
        """One request's deltas; closing the iterator early aborts the request."""
        async with self.add_request([prompt_ids], [params], request_id) as stream:
            async for items in stream:
                for _, delta in items:
                    yield delta

    def abort(self, request_id: str) -> None:
        """Forget a request here and abort it in the core (a no-op if it already finished)."""
        self._forget(request_id, "abort")

    def _forget(self, request_id: str, outcome: str) -> tuple[_Entry, str] | None:
        """Drop a request from the front end, count its outcome, abort it in the core. Returns its entry and
        the text the detokenizer still held (released at the end: it was no stop string)."""
        e = self._entries.pop(request_id, None)
        if e is None:
            return None
        self._ended(e)
        if e.first_t is None:
            self._num_waiting -= 1
        out = self.processor.abort(request_id)
        self.processor.release(request_id)
        self.metrics.requests.labels(outcome).inc()
        self.client.abort(request_id, outcome)
        return e, out.delta_text if out is not None else ""

    def _moved(self, request_id: str, replica: str) -> None:
        """The client retried a request on another replica (before it streamed)."""
        e = self._entries.get(request_id)
        if e is not None:
            e.stream.replicas[e.index] = replica

    # outputs from the client -------------------------------------------------------------------
    def _process(self, out: CoreOutputs) -> None:
        """The client's outputs, on the event loop: detokenize, check stops, feed the streams."""
        updated, stopped = self.processor.process(out.deltas, out.step)
        for rid in stopped:
            self.client.abort(rid, "stop")
        now = time.perf_counter()
        m = self.metrics
        for o in updated:
            e = self._entries.get(o.request_id)
            if e is None:
                continue
            new_ids = o.token_ids[e.num_seen:]
            lps = o.logprobs[e.num_seen:] if o.logprobs is not None else None
            e.num_seen = len(o.token_ids)
            prompt_lps = o.prompt_logprobs if e.first_t is None else None  # they came with the first token
            if e.first_t is None:
                e.first_t = now
                self._num_waiting -= 1
                m.ttft.observe(now - e.arrival)
            else:
                m.itl.observe(now - e.last_t)
            e.last_t = now
            beams = [self._beam_delta(b, e) for b in o.beams[1:]] if o.beams is not None else None
            m.generation_tokens.inc(len(new_ids) + sum(len(b.token_ids) for b in beams or ()))  # every choice's
            e.stream._put(e.index, GenerationDelta(o.delta_text, new_ids, lps, e.num_prompt_tokens, e.num_seen,
                                                   o.finished, o.finish_reason, o.stop_reason, prompt_lps), beams)
            if o.finished:
                self._ended(self._entries.pop(o.request_id))
                self.processor.release(o.request_id)
                m.e2e.observe(now - e.arrival)
                m.requests.labels(o.finish_reason or "stop").inc()
        for rid, reason in out.failed:
            log.error("request %s failed in the core: %s", rid, reason)
            self._fail(rid, EngineFailed(reason))
        for rid, kind, reason in out.refused:  # what check_prompt does not foresee (beam groups' blocks, seats)
            self._fail(rid, CapacityError(reason) if kind == "capacity" else RequestError(reason))
        if out.dead is not None:
            self._fail_all(EngineFailed(out.dead))

    def _beam_delta(self, beam: BeamOutput, e: _Entry) -> GenerationDelta:
        """A finished beam after the best, as its choice's only delta, with why it ended."""
        return GenerationDelta(beam.text, list(beam.token_ids), None, e.num_prompt_tokens, len(beam.token_ids),
                               True, beam.finish_reason, beam.stop_reason)

    def _ended(self, e: _Entry) -> None:
        if e.deadline is not None:
            e.deadline.cancel()
        if not self._entries and self._empty is not None:
            self._empty.set()

    def _expire(self, request_id: str) -> None:
        """The generation deadline passed: finish the request with what it has. Its finish_reason is vLLM's
        "abort" (OpenAI has no "timeout"; "length" would claim max_tokens or the context ran out); the
        requests metric and the core's abort name the cause, "timeout"."""
        gone = self._forget(request_id, "timeout")
        if gone is not None:
            e, held = gone
            e.stream._put(e.index, GenerationDelta(held, [], None, e.num_prompt_tokens, e.num_seen, True, "abort"))

    def _fail(self, request_id: str, error: Exception) -> None:
        """End a request with an error its reader will raise; aborts it in the core too."""
        gone = self._forget(request_id, "error")
        if gone is not None:
            e, _ = gone
            e.stream._fail(e.index, error)

    def _fail_all(self, error: Exception) -> None:
        for rid in list(self._entries):
            self._fail(rid, error)
