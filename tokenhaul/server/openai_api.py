"""The OpenAI generation endpoints: validate, tokenize and admit a request (so every refusal is a
4xx with an OpenAI error body before any byte is streamed), then read its RequestStream — as SSE
chunks, or gathered into one response. A client that disconnects aborts its requests."""

from __future__ import annotations

import asyncio
import codecs
import contextlib
import json
import math
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from tokenhaul.errors import CapacityError, RequestError, TokenhaulError
from tokenhaul.outputs import TokenLogprob
from tokenhaul.server import protocol as P
from tokenhaul.server.async_engine import (
    AsyncEngine,
    EngineFailed,
    EngineOverloaded,
    EngineUnavailable,
    GenerationDelta,
    PromptTooLong,
    RequestStream,
)
from tokenhaul.server.tools import ToolStream, read_tool_use

MAX_CHOICES = 64  # prompts × n per call
REPLICA_HEADER = "x-tokenhaul-replica"  # which engine replica served the call (as routed at admission)
_FIELDS = set(P.ChatCompletionRequest.model_fields) | set(P.CompletionRequest.model_fields) | set(P.REFUSED_EXTRAS)
# one completions logprobs row: token id, logprob (None: the prompt's first token), the k best, its bytes in the text
_Row = tuple[int, float | None, list[tuple[int, float]] | None, bytes]


class APIError(Exception):
    """An HTTP error with an OpenAI error body: {"error": {"message", "type", "param", "code"}}."""

    def __init__(self, status: int, message: str, type: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None, headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code
        self.headers = headers

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)


def unknown_model(engine: AsyncEngine, model: str) -> APIError:
    """404 for a model name this server does not serve (OpenAI's code model_not_found)."""
    return APIError(404, f"model '{model}' does not exist; this server serves '{engine.model_name}'",
                    param="model", code="model_not_found")


def check_model(engine: AsyncEngine, model: str | None) -> None:
    """The served model's name, or none (null or "", as vLLM: the served model); else 404, counted as rejected."""
    if model and model != engine.model_name:
        engine.metrics.rejected.labels("model_not_found").inc()
        raise unknown_model(engine, model)


def refused(engine: AsyncEngine, e: TokenhaulError, prompt_param: str = "prompt") -> APIError:
    """A request refused while it is read (sampling parameters, prompt), counted as rejected."""
    engine.metrics.rejected.labels("invalid").inc()
    return api_error(e, prompt_param)


class ClientGone(Exception):
    """The client disconnected before a non-streamed response was ready; its requests are aborted."""


def api_error(e: TokenhaulError, prompt_param: str = "prompt") -> APIError:
    """Engine-side exception → HTTP status and OpenAI error body."""
    msg = str(e)
    if isinstance(e, EngineOverloaded):
        return APIError(429, msg, "rate_limit_error", code="queue_full", headers={"Retry-After": "1"})
    if isinstance(e, EngineUnavailable):
        return APIError(503, msg, "service_unavailable", code="engine_unavailable")
    if isinstance(e, EngineFailed):
        return APIError(500, msg, "server_error", code="engine_error")
    if isinstance(e, PromptTooLong):
        return APIError(400, msg, param=prompt_param, code="context_length_exceeded")
    if isinstance(e, CapacityError):
        return APIError(400, msg, param="max_tokens", code="kv_capacity_exceeded")
    if isinstance(e, RequestError):
        first = msg.split(" ", 1)[0].removesuffix(":")  # "field: ..." names it too
        return APIError(400, msg, param=first if first in _FIELDS else None)
    return APIError(500, msg, "server_error")


@dataclass
class _Choice:
    """One choice of a non-streamed response, gathered from its deltas."""

    text: str = ""
    num_tokens: int = 0
    logprobs: list = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    prompt_logprobs: list[TokenLogprob | None] | None = None

    def add(self, d: GenerationDelta) -> None:
        self.prompt_logprobs = self.prompt_logprobs or d.prompt_logprobs
        self.text += d.text
        self.num_tokens = d.num_output_tokens
        self.logprobs += d.logprobs or []
        if d.finished:
            self.finish_reason, self.stop_reason = d.finish_reason, d.stop_reason


class OpenAIHandlers:
    """The two generation endpoints; one instance per app."""

    def __init__(self, engine: AsyncEngine, tool_parser: str | None = None) -> None:
        self.engine = engine
        self.tool_parser = tool_parser  # with --enable-auto-tool-choice: tool_choice "auto" is served by it
        self._token_text: dict[int, str] = {}
        self._token_bytes: dict[int, bytes] = {}
        self._frame_hist = engine.metrics.last_mile.labels("frame")

    # shared steps ----------------------------------------------------------------------------
    def _admit(self, prompts: list[list[int]], params: list, prefix: str, prompt_param: str) -> RequestStream:
        try:
            return self.engine.add_request(prompts, params, prefix)
        except TokenhaulError as e:
            reason = {EngineOverloaded: "queue_full", EngineUnavailable: "unavailable"}.get(type(e), "invalid")
            self.engine.metrics.rejected.labels(reason).inc()
            raise api_error(e, prompt_param) from None

    def token_text(self, token_id: int) -> str:
        s = self._token_text.get(token_id)
        if s is None:
            s = self._token_text[token_id] = self.engine.tokenizer.decode([token_id], skip_special_tokens=False)
        return s

    def token_bytes(self, token_id: int) -> bytes:
        b = self._token_bytes.get(token_id)
        if b is None:
            b = self._token_bytes[token_id] = self.engine.tokenizer.token_bytes(token_id)
        return b

    async def _gather(self, stream: RequestStream, n: int, request: Request) -> list[_Choice]:
        """Read a stream to its end, one _Choice per choice; aborts the stream if the client
        disconnects first."""

        async def read() -> list[_Choice]:
            acc = [_Choice() for _ in range(n)]
            async with stream:
                async for items in stream:
                    for i, d in items:
                        acc[i].add(d)
            return acc

        try:
            return await _unless_disconnected(request, read())
        except (EngineFailed, EngineUnavailable) as e:
            raise api_error(e) from None

    def _sse(self, stream: RequestStream, frames: Callable[[list[tuple[int, GenerationDelta]]], list[dict]],
             tail: Callable[[], list[dict]], head: list[dict] | None = None,
             usage: Callable[[], dict] | None = None) -> StreamingResponse:
        """The SSE response: head chunks, frames per stream item, tail chunks, [DONE]; with `usage`, every chunk
        carries the usage so far (vLLM's stream_options.continuous_usage_stats)."""
        hist = self._frame_hist

        def text(chunks: list[dict]) -> str:
            return "".join(_frame(c if usage is None else c | {"usage": usage()}) for c in chunks)

        async def gen() -> AsyncIterator[str]:
            async with stream:
                try:
                    if head:
                        yield text(head)
                    async for items in stream:
                        t0 = time.perf_counter()
                        out = text(frames(items))
                        hist.observe(time.perf_counter() - t0)
                        if out:
                            yield out
                    yield text(tail())
                except (EngineFailed, EngineUnavailable) as e:
                    yield _frame(api_error(e).body())
                yield "data: [DONE]\n\n"

        return StreamingResponse(gen(), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no",
                                          REPLICA_HEADER: stream.replica})

    # /v1/completions ---------------------------------------------------------------------------
    async def completions(self, body: P.CompletionRequest, request: Request) -> Response:
        e = self.engine
        check_model(e, body.model)
        try:
            body.check_unsupported()
            batch = _num_prompts(body.prompt)
            if batch * body.n > MAX_CHOICES:
                raise RequestError(f"n × prompts is {batch * body.n}; at most {MAX_CHOICES} per call")
            prompts = await self._completion_prompts(body.prompt)
            echoes = await self._echo_texts(body, prompts) if body.echo else None
            # echo with max_tokens 0 scores the prompt (OpenAI's, vLLM's echo without generation): the engine runs
            # one token, and the choices hold the prompt alone, its logprobs with logprobs
            scoring = body.echo and body.max_tokens == 0
            if body.max_tokens == 0 and not body.echo:
                raise RequestError("max_tokens must be at least 1 (0 only with echo: the prompt scored alone)")
            max_tokens = 1 if scoring else body.max_tokens if body.max_tokens is not None else 16
            echo_k = body.logprobs if body.echo else None  # echo's logprobs cover the prompt too
            # vLLM's prompt_logprobs, else echo's k (its to_sampling_params); no stream chunk carries them
            shown_k = None if body.stream else body.prompt_logprobs if body.prompt_logprobs is not None else echo_k
            engine_k = max((k for k in (shown_k, echo_k) if k is not None), default=None)
            per_prompt = [body.choice_params(max_tokens, body.logprobs, engine_k, every_choice=body.stream)
                          for _ in prompts]
        except TokenhaulError as err:
            raise refused(e, err) from None
        params = [p for ps in per_prompt for p in ps]
        flat = [ids for ids, ps in zip(prompts, per_prompt) for _ in ps]
        num_choices = len(prompts) * body.n
        rid = f"cmpl-{uuid.uuid4().hex}"
        stream = self._admit(flat, params, rid, "prompt")
        created, model = int(time.time()), e.model_name
        n_prompt = sum(len(p) for p in prompts)
        want_lp = body.logprobs is not None
        k = body.logprobs or 0
        offsets = _TextOffsets(num_choices)
        out_tokens = [0] * num_choices
        shown = [self._echoed_bytes(body, ids) for ids in prompts] if echo_k is not None else []

        def echo_rows(i: int, prompt_lps: list[TokenLogprob | None] | None) -> list[_Row]:
            """Choice i's prompt tokens as logprobs rows (no logprobs if none came: the request ended first)."""
            ids = prompts[i // body.n]
            plps = prompt_lps or [None] * len(ids)
            return [(tid, None if p is None else p.logprob, None if p is None else (p.top or [])[:k], b)
                    for tid, p, b in zip(ids, plps, shown[i // body.n])]

        def usage() -> dict:
            done = sum(out_tokens)
            return {"prompt_tokens": n_prompt, "completion_tokens": done, "total_tokens": n_prompt + done}

        if not body.stream:
            acc = await self._gather(stream, num_choices, request)
            choices = []
            for i, c in enumerate(acc):
                if scoring:  # the token the engine ran is not the client's, nor why it ended: cut at 0 tokens
                    c = _Choice(finish_reason="length")
                out_tokens[i] = c.num_tokens
                prompt_lps = acc[i - i % body.n].prompt_logprobs  # the prompt's first choice asked for them
                lp = None
                if want_lp:
                    head = echo_rows(i, prompt_lps) if echo_k is not None else []
                    lp = self._completion_logprobs(head + self._rows(c.logprobs), offsets, i)
                text = c.text if echoes is None else echoes[i // body.n] + c.text
                choices.append({"index": i, "text": text, "logprobs": lp, "finish_reason": c.finish_reason,
                                "stop_reason": c.stop_reason,
                                "prompt_logprobs": self._prompt_logprobs(prompt_lps, shown_k)})
            return JSONResponse({"id": rid, "object": "text_completion", "created": created, "model": model,
                                 "choices": choices, "usage": usage()}, headers={REPLICA_HEADER: stream.replica})

        unechoed = set(range(num_choices)) if echo_k is not None else set()
        scored: dict[int, list[TokenLogprob | None] | None] = {}  # scoring: prompt logprobs held to the chunk

        def frames(items: list[tuple[int, GenerationDelta]]) -> list[dict]:
            choices = []
            for i, d in items:
                if scoring:  # one chunk per choice once its engine token is done: the prompt and its logprobs (vLLM)
                    scored[i] = scored.get(i) or d.prompt_logprobs
                    if d.finished:
                        lp = self._completion_logprobs(echo_rows(i, scored.pop(i)), offsets, i) if want_lp else None
                        choices.append({"index": i, "text": echoes[i // body.n], "logprobs": lp,
                                        "finish_reason": "length", "stop_reason": None})
                    continue
                out_tokens[i] = d.num_output_tokens
                if not d.text and not d.finished and not want_lp:
                    continue  # held back (stop-string prefix or incomplete character): nothing to say
                text, lp = d.text, None
                if i in unechoed:  # echo with logprobs: the prompt and its logprobs with the first token (vLLM)
                    unechoed.discard(i)
                    text = echoes[i // body.n] + text
                    lp = self._completion_logprobs(echo_rows(i, d.prompt_logprobs) + self._rows(d.logprobs or []),
                                                   offsets, i)
                elif want_lp:
                    lp = self._completion_logprobs(self._rows(d.logprobs or []), offsets, i)
                choices.append({"index": i, "text": text, "logprobs": lp,
                                "finish_reason": d.finish_reason if d.finished else None,
                                "stop_reason": d.stop_reason})
            if not choices:
                return []
            return [{"id": rid, "object": "text_completion", "created": created, "model": model,
                     "choices": choices}]

        def tail() -> list[dict]:
            if not (body.stream_options and body.stream_options.include_usage):
                return []
            return [{"id": rid, "object": "text_completion", "created": created, "model": model,
                     "choices": [], "usage": usage()}]

        head = None
        if echoes is not None and echo_k is None and not scoring:  # each choice's prompt first, as its own chunk
            head = [{"id": rid, "object": "text_completion", "created": created, "model": model,
                     "choices": [{"index": i, "text": echoes[i // body.n], "logprobs": None, "finish_reason": None,
                                  "stop_reason": None} for i in range(num_choices)]}]
        return self._sse(stream, frames, tail, head, usage if _continuous_usage(body) else None)

    async def _echo_texts(self, body: P.CompletionRequest, prompts: list[list[int]]) -> list[str]:
        """Each prompt's text for echo: as sent, or its token ids decoded (off the event loop)."""
        if isinstance(body.prompt, str):
            return [body.prompt]
        if isinstance(body.prompt[0], str):
            return list(body.prompt)
        decode = self.engine.tokenizer.decode
        return await asyncio.to_thread(lambda: [decode(p, skip_special_tokens=body.skip_special_tokens)
                                                for p in prompts])

    async def _completion_prompts(self, prompt: str | list) -> list[list[int]]:
        if isinstance(prompt, str):
            return [await self.engine.encode(prompt)]
        if not prompt:
            raise RequestError("prompt is empty")
        if isinstance(prompt[0], int):
            prompts = [prompt]
        elif isinstance(prompt[0], str):
            return [await self.engine.encode(p) for p in prompt]
        else:
            prompts = prompt
        for p in prompts:
            self.engine.limits.check_token_ids(p)
        return [list(p) for p in prompts]

    def _echoed_bytes(self, body: P.CompletionRequest, ids: list[int]) -> list[bytes]:
        """Each prompt token's bytes in its echoed text: a text prompt is echoed as sent (without the BOS or EOS the
        tokenizer added), a prompt of ids decoded (without its special tokens, unless skip_special_tokens is false)."""
        tok = self.engine.tokenizer
        data = [self.token_bytes(t) for t in ids]
        if isinstance(body.prompt, str) or isinstance(body.prompt[0], str):
            if tok.add_bos and tok.bos_token_id is not None:
                data[0] = b""
            if tok.meta.add_eos and tok.eos_token_ids:
                data[-1] = b""
            return data
        return [b"" if body.skip_special_tokens and tok.is_special(t) else b for t, b in zip(ids, data)]

    def _rows(self, lps: list[TokenLogprob]) -> list[_Row]:
        return [(t.token_id, _finite(t.logprob), t.top, self.token_bytes(t.token_id)) for t in lps]

    def _completion_logprobs(self, rows: list[_Row], offsets: _TextOffsets, i: int) -> dict:
        """OpenAI's completions logprobs of choice i: tokens, logprobs, the k best (and the token) by text, and where
        each token's text starts in the choice's text."""
        tokens, values, tops, text_offset = [], [], [], []
        for token_id, value, top, data in rows:
            t = self.token_text(token_id)
            tokens.append(t)
            text_offset.append(offsets.advance(i, data))
            if value is None:  # the prompt's first token: nothing before it to predict it (OpenAI, vLLM)
                values.append(None)
                tops.append(None)
                continue
            values.append(_finite(value))
            best = {self.token_text(tid): _finite(v) for tid, v in top or []}
            best[t] = values[-1]  # and the token, where it is not among the k (vLLM; up to k + 1 entries)
            tops.append(best)
        return {"tokens": tokens, "token_logprobs": values, "top_logprobs": tops, "text_offset": text_offset}

    def _prompt_logprobs(self, lps: list[TokenLogprob | None] | None, k: int | None) -> list[dict | None] | None:
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
        return {"logprob": _finite(logprob), "rank": rank, "decoded_token": self.token_text(token_id)}

    # /v1/chat/completions ----------------------------------------------------------------------
    async def chat(self, body: P.ChatCompletionRequest, request: Request) -> Response:
        e = self.engine
        check_model(e, body.model)
        try:
            body.check_unsupported()
            if body.top_logprobs is not None and not body.logprobs:
                raise RequestError("top_logprobs requires logprobs to be true")
            messages = [m.as_template_dict() for m in body.messages]
            tool_use = read_tool_use(body.tools, body.tool_choice, self.tool_parser)
            kwargs = body.chat_template_kwargs
            if tool_use is not None:  # the template gets the tools, with "none" too (vLLM's default); kwargs win
                kwargs = {"tools": tool_use.tools} | (kwargs or {})
            prompt = await e.encode_chat(messages, body.add_generation_prompt, body.continue_final_message,
                                         template_kwargs=kwargs)
            max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
            if max_tokens is None:  # as much as fits in the context and the KV pool
                room = min(e.limits.max_model_len, e.limits.num_blocks * e.limits.block_size) - len(prompt)
                max_tokens = max(1, room)
            lp = (body.top_logprobs or 0) if body.logprobs else None
            shown_k = None if body.stream else body.prompt_logprobs  # no stream chunk carries them (vLLM)
            params = body.choice_params(max_tokens, lp, shown_k, tool_schema=tool_use and tool_use.schema())
        except TokenhaulError as err:
            raise refused(e, err, "messages") from None
        rid = f"chatcmpl-{uuid.uuid4().hex}"
        stream = self._admit([prompt] * len(params), params, rid, "messages")
        created, model = int(time.time()), e.model_name
        out_tokens = [0] * body.n
        want_lp = body.logprobs

        def usage() -> dict:
            done = sum(out_tokens)
            return {"prompt_tokens": len(prompt), "completion_tokens": done, "total_tokens": len(prompt) + done}

        if not body.stream:
            acc = await self._gather(stream, body.n, request)
            choices = []
            for i, c in enumerate(acc):
                out_tokens[i] = c.num_tokens
                message, reason = ({"role": "assistant", "content": c.text}, c.finish_reason) if tool_use is None \
                    else tool_use.message(c.text, c.finish_reason)
                choices.append({"index": i, "message": message,
                                "logprobs": {"content": self._chat_logprobs(c.logprobs)} if want_lp else None,
                                "finish_reason": reason, "stop_reason": c.stop_reason})
            return JSONResponse({"id": rid, "object": "chat.completion", "created": created, "model": model,
                                 "choices": choices, "usage": usage(),
                                 "prompt_logprobs": self._prompt_logprobs(acc[0].prompt_logprobs, shown_k)},
                                headers={REPLICA_HEADER: stream.replica})

        def chunk(choices: list[dict]) -> dict:
            return {"id": rid, "object": "chat.completion.chunk", "created": created, "model": model,
                    "choices": choices}

        head = [chunk([{"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                        "finish_reason": None} for i in range(body.n)])]

        tool_streams = [ToolStream(tool_use) for _ in range(body.n)]

        def frames(items: list[tuple[int, GenerationDelta]]) -> list[dict]:
            choices = []
            for i, d in items:
                out_tokens[i] = d.num_output_tokens
                delta, reason = tool_streams[i].delta(d.text, d.finished, d.finish_reason)
                if not delta and not d.finished and not want_lp:
                    continue
                choices.append({"index": i, "delta": delta,
                                "logprobs": {"content": self._chat_logprobs(d.logprobs or [])} if want_lp else None,
                                "finish_reason": reason if d.finished else None,
                                "stop_reason": d.stop_reason})
            return [chunk(choices)] if choices else []

        def tail() -> list[dict]:
            if not (body.stream_options and body.stream_options.include_usage):
                return []
            return [chunk([]) | {"usage": usage()}]

        return self._sse(stream, frames, tail, head, usage if _continuous_usage(body) else None)

    def _chat_logprobs(self, lps: list) -> list[dict]:
        out = []
        for lp in lps:
            t = self.token_text(lp.token_id)
            top = [{"token": self.token_text(tid), "logprob": _finite(v), "bytes": list(self.token_bytes(tid))}
                   for tid, v in (lp.top or [])]
            out.append({"token": t, "logprob": _finite(lp.logprob), "bytes": list(self.token_bytes(lp.token_id)),
                        "top_logprobs": top})
        return out


class _TextOffsets:
    """Per choice, where the next token's text starts in the choice's text, in characters: a token carrying part of
    a UTF-8 character adds none until the character is whole."""

    def __init__(self, n: int) -> None:
        self.chars = [0] * n
        self._utf8 = [codecs.getincrementaldecoder("utf-8")("replace") for _ in range(n)]

    def advance(self, i: int, data: bytes) -> int:
        """Choice i's offset before a token of these bytes; then move past it."""
        at = self.chars[i]
        self.chars[i] += len(self._utf8[i].decode(data))
        return at


def _continuous_usage(body: P.CompletionRequest | P.ChatCompletionRequest) -> bool:
    return body.stream_options is not None and body.stream_options.continuous_usage_stats


def _num_prompts(prompt: str | list) -> int:
    """A string or one list of token ids is one prompt; a list of strings or of id lists is several."""
    return len(prompt) if isinstance(prompt, list) and prompt and not isinstance(prompt[0], int) else 1


def _finite(x: float | None) -> float:
    return -9999.0 if x is None or not math.isfinite(x) else x


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

