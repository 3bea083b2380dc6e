"""What the generation endpoints share: admitting a request (every refusal a 4xx with an OpenAI error body before
any byte is streamed), reading its RequestStream as SSE chunks or gathered into one response (a client that
disconnects aborts its requests), token strings, and vLLM's prompt_logprobs."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import math
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from fastapi import Request
from fastapi.responses import StreamingResponse

from tokenhaul.errors import RequestError, TokenhaulError
from tokenhaul.outputs import TokenLogprob
from tokenhaul.sampling_params import SamplingParams, truncate_prompt
from tokenhaul.server.async_engine import (
    AsyncEngine,
    EngineFailed,
    EngineOverloaded,
    EngineUnavailable,
    GenerationDelta,
    RequestStream,
)
from tokenhaul.server.errors import ClientGone, api_error
from tokenhaul.server.protocol import SamplingRequest, StreamOptions

# which engine replica served the call: a request is retried on another replica only before it streamed (cluster/
# pool.py), so a JSON response names the one that ran it, and an SSE response sends its headers at once where the
# engine client never moves requests (EngineClient.moves_requests), else once the stream has output (_SSEResponse);
# with several prompts, one that had not streamed by then may still move
REPLICA_HEADER = "x-tokenhaul-replica"


@dataclass
class GatheredChoice:
    """One choice of a non-streamed response, gathered from its deltas."""

    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    num_tokens: int = 0
    logprobs: list = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    prompt_logprobs: list[TokenLogprob | None] | None = None

    def add(self, d: GenerationDelta) -> None:
        self.prompt_logprobs = self.prompt_logprobs or d.prompt_logprobs
        self.text += d.text
        self.token_ids += d.token_ids
        self.num_tokens = d.num_output_tokens
        self.logprobs += d.logprobs or []
        if d.finished:
            self.finish_reason, self.stop_reason = d.finish_reason, d.stop_reason


class OpenAIServing:
    """The steps a generation endpoint's handler shares (one handler instance per app)."""

    def __init__(self, engine: AsyncEngine) -> None:
        self.engine = engine
        self._token_text: dict[int, str] = {}
        self._token_bytes: dict[int, bytes] = {}
        self._frame_hist = engine.metrics.last_mile.labels("frame")

    def admit(self, prompts: list[list[int]], params: list, prefix: str, prompt_param: str) -> RequestStream:
        try:
            return self.engine.add_request(prompts, params, prefix)
        except TokenhaulError as e:
            reason = {EngineOverloaded: "queue_full", EngineUnavailable: "unavailable"}.get(type(e), "invalid")
            self.engine.metrics.rejected.labels(reason).inc()
            raise api_error(e, prompt_param) from None

    def truncate(self, body: SamplingRequest, prompt: list[int]) -> list[int]:
        """vLLM's truncate_prompt_tokens, applied before admission (sampling_params.truncate_prompt)."""
        return truncate_prompt(prompt, body.truncate_prompt_tokens, self.engine.limits.max_model_len)

    async def tokenize_bad_words(self, params: list[SamplingParams]) -> None:
        """Each engine request's bad_words tokenized for the core (SamplingParams.update_from_tokenizer, as LLM does),
        off the event loop; the choices' words, the same, are encoded once."""
        if not any(p.bad_words for p in params):
            return
        tok = self.engine.tokenizer

        def run() -> None:
            encode = functools.cache(lambda t: tuple(tok.encode(t, add_special_tokens=False)))
            for p in params:
                if p.bad_words:
                    p.update_from_tokenizer(lambda t: list(encode(t)))

        await asyncio.to_thread(run)

    def room(self, num_prompt_tokens: int) -> int:
        """max_tokens for "up to the context's end" (vLLM's max_tokens=None): what fits after the prompt in the context
        and the KV pool (at least 1: a prompt too long is refused at admission, by its length)."""
        lim = self.engine.limits
        return max(1, min(lim.max_model_len, lim.num_blocks * lim.block_size) - num_prompt_tokens)

    def token_text(self, token_id: int) -> str:
        s = self._token_text.get(token_id)
        if s is None:
            s = self._token_text[token_id] = self.engine.tokenizer.decode([token_id], skip_special_tokens=False)
        return s

    def token_name(self, token_id: int, as_id: bool = False) -> str:
        """A logprobs token's string: its text, or vLLM's "token_id:N" (return_tokens_as_token_ids)."""
        return f"token_id:{token_id}" if as_id else self.token_text(token_id)

    def token_bytes(self, token_id: int) -> bytes:
        b = self._token_bytes.get(token_id)
        if b is None:
            b = self._token_bytes[token_id] = self.engine.tokenizer.token_bytes(token_id)
        return b

    async def gather(self, stream: RequestStream, n: int, request: Request) -> list[GatheredChoice]:
        """Read a stream to its end, one GatheredChoice per choice; aborts the stream if the client
        disconnects first."""

        async def read() -> list[GatheredChoice]:
            acc = [GatheredChoice() for _ in range(n)]
            async with stream:
                async for items in stream:
                    for i, d in items:
                        acc[i].add(d)
            return acc

        try:
            return await _unless_disconnected(request, read())
        except (EngineFailed, EngineUnavailable, RequestError) as e:  # RequestError: refused by the core
            raise api_error(e) from None

    def sse(self, stream: RequestStream, frames: Callable[[list[tuple[int, GenerationDelta]]], list[dict]],
            tail: Callable[[], list[dict]], head: list[dict] | None = None,
            usage: Callable[[], dict] | None = None) -> StreamingResponse:
        """The SSE response: head chunks, frames per stream item, tail chunks, [DONE]; with `usage`, every chunk
        carries the usage so far (vLLM's stream_options.continuous_usage_stats). A chunk holding several choices is
        sent as one chunk per choice, in order (OpenAI's and vLLM's: clients read `choices[0]`)."""
        hist = self._frame_hist
        moves = self.engine.client.moves_requests  # then the replica is final only once the stream has output

        def text(chunks: list[dict]) -> str:
            return "".join(_frame(c if usage is None else c | {"usage": usage()}) for c in _one_choice_each(chunks))

        async def gen() -> AsyncIterator[str]:
            async with stream:
                try:
                    if moves:
                        await stream.started()  # the replica is known (the headers go with the first chunk)
                    if head:
                        yield text(head)
                    async for items in stream:
                        t0 = time.perf_counter()
                        out = text(frames(items))
                        hist.observe(time.perf_counter() - t0)
                        if out:
                            yield out
                    yield text(tail())
                except (EngineFailed, EngineUnavailable, RequestError) as e:  # RequestError: refused by the core
                    yield _frame(api_error(e).body())
                yield "data: [DONE]\n\n"

        headers = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
        if moves:
            return _SSEResponse(stream, gen(), media_type="text/event-stream", headers=headers)
        return StreamingResponse(gen(), media_type="text/event-stream",
                                 headers=headers | {REPLICA_HEADER: stream.replica})

    def prompt_logprobs(self, lps: list[TokenLogprob | None] | None, k: int | None) -> list[dict | None] | None:
        """vLLM's prompt_logprobs (None unless k): per prompt token, token id → {logprob, rank, decoded_token} of
        the token itself (its rank among the vocabulary, from the engine), then of the k most likely (ranks 1..k;
        the token among them is one key, ranked there), as vLLM."""
        if k is None or lps is None:
            return None
        out: list[dict | None] = []
        for lp in lps:
            if lp is None:
                out.append(None)
                continue
            top = (lp.top or [])[:k]
            rank = next((r for r, (tid, _) in enumerate(top, 1) if tid == lp.token_id), lp.rank)
            entries = {str(lp.token_id): self._prompt_entry(lp.token_id, lp.logprob, rank)}
            for r, (tid, v) in enumerate(top, 1):
                entries.setdefault(str(tid), self._prompt_entry(tid, v, r))
            out.append(entries)
        return out

    def _prompt_entry(self, token_id: int, logprob: float, rank: int | None) -> dict:
        return {"logprob": finite(logprob), "rank": rank, "decoded_token": self.token_text(token_id)}


class _SSEResponse(StreamingResponse):
    """A StreamingResponse whose headers go out with its first chunk, naming the replica that serves its stream."""

    def __init__(self, stream: RequestStream, content: AsyncIterator[str], **kw: Any) -> None:
        super().__init__(content, **kw)
        self._stream = stream

    async def stream_response(self, send: Callable[[dict], Awaitable[None]]) -> None:
        body = aiter(self.body_iterator)
        first = await anext(body, None)
        self.headers[REPLICA_HEADER] = self._stream.replica

        async def chunks() -> AsyncIterator[str]:
            if first is not None:
                yield first
            async for chunk in body:
                yield chunk

        self.body_iterator = chunks()
        await super().stream_response(send)


def continuous_usage(stream_options: StreamOptions | None) -> bool:
    """vLLM's stream_options.continuous_usage_stats: every chunk carries the usage so far."""
    return stream_options is not None and stream_options.continuous_usage_stats


def finite(x: float | None) -> float:
    """A logprob as JSON can carry it: -inf (or none) as -9999.0."""
    return -9999.0 if x is None or not math.isfinite(x) else x


def _one_choice_each(chunks: list[dict]) -> list[dict]:
    """Each chunk with more than one choice split into chunks of one choice each (the same id, in order); a chunk of
    one choice, or none (a usage chunk), as it is."""
    out = []
    for c in chunks:
        choices = c.get("choices")
        if choices is not None and len(choices) > 1:
            out += [c | {"choices": [choice]} for choice in choices]
        else:
            out.append(c)
    return out


def _frame(obj: dict) -> str:
    return "data: " + json.dumps(obj, ensure_ascii=False, separators=(",", ":")) + "\n\n"


async def _unless_disconnected(request: Request, work: Awaitable[Any]) -> Any:
    """Run `work`; if the client disconnects first, cancel it (its `async with stream` aborts the
    engine requests) and raise ClientGone."""
    task = asyncio.ensure_future(work)

    async def disconnected() -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass

    watcher = asyncio.ensure_future(disconnected())
    try:
        done, _ = await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    except BaseException:  # the handler itself was cancelled (server shutdown)
        task.cancel()
        raise
    finally:
        watcher.cancel()
    if task in done:
        return task.result()
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task
    raise ClientGone()
