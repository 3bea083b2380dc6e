"""/v1/completions: prompts (text, token ids, or lists of either) × n choices, with OpenAI's echo and logprobs
(the prompt's tokens first with echo, where each token's text starts) and vLLM's prompt_logprobs; streamed as SSE
chunks or gathered into one response."""

from __future__ import annotations

import asyncio
import codecs
import time
import uuid

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from tokenhaul.errors import RequestError, TokenhaulError
from tokenhaul.outputs import TokenLogprob
from tokenhaul.sampling_params import MAX_N
from tokenhaul.server.async_engine import GenerationDelta
from tokenhaul.server.completion_protocol import CompletionRequest
from tokenhaul.server.errors import check_model, refused
from tokenhaul.server.serving import REPLICA_HEADER, GatheredChoice, OpenAIServing, continuous_usage, finite

MAX_CHOICES = MAX_N  # prompts × n per call: one prompt may take the largest n
# one completions logprobs row: token id, logprob (None: the prompt's first token), the k best, its bytes in the text
_Row = tuple[int, float | None, list[tuple[int, float]] | None, bytes]


class CompletionsHandler(OpenAIServing):
    """/v1/completions; one instance per app."""

    async def completions(self, body: CompletionRequest, request: Request) -> Response:
        e = self.engine
        check_model(e, body.model)
        try:
            body.check_unsupported()
            batch = _num_prompts(body.prompt)
            if batch * body.n > MAX_CHOICES:
                raise RequestError(f"n × prompts is {batch * body.n}; at most {MAX_CHOICES} per call")
            prompts = await self._completion_prompts(body.prompt)
            kept = [self.truncate(body, ids) for ids in prompts]  # vLLM's truncate_prompt_tokens
            whole = [len(k) == len(ids) for k, ids in zip(kept, prompts)]
            prompts = kept
            echoes = await self._echo_texts(body, prompts, whole) if body.echo else None
            # echo with max_tokens 0 scores the prompt (OpenAI's, vLLM's echo without generation): the engine runs
            # one token, and the choices hold the prompt alone, its logprobs with logprobs
            scoring = body.echo and body.max_tokens == 0
            if body.max_tokens == 0 and not body.echo:
                raise RequestError("max_tokens must be at least 1 (0 only with echo: the prompt scored alone)")
            # left out: 16 (OpenAI's, vLLM's default); null: up to the context's end (vLLM's max_tokens=None)
            to_end = body.max_tokens is None and "max_tokens" in body.model_fields_set
            max_tokens = 1 if scoring else body.max_tokens if body.max_tokens is not None else 16
            echo_k = body.logprobs if body.echo else None  # echo's logprobs cover the prompt too
            # vLLM's prompt_logprobs, else echo's k (its to_sampling_params); no stream chunk carries them
            shown_k = None if body.stream else body.prompt_logprobs if body.prompt_logprobs is not None else echo_k
            engine_k = max((k for k in (shown_k, echo_k) if k is not None), default=None)
            per_prompt = [body.choice_params(self.room(len(ids)) if to_end else max_tokens, body.logprobs, engine_k)
                          for ids in prompts]
            await self.tokenize_bad_words([p for ps in per_prompt for p in ps])
        except TokenhaulError as err:
            raise refused(e, err) from None
        params = [p for ps in per_prompt for p in ps]
        flat = [ids for ids, ps in zip(prompts, per_prompt) for _ in ps]
        num_choices = len(prompts) * body.n
        rid = f"cmpl-{uuid.uuid4().hex}"
        stream = self.admit(flat, params, rid, "prompt")
        created, model = int(time.time()), e.model_name
        n_prompt = sum(len(p) for p in prompts)
        want_lp = body.logprobs is not None
        as_ids = bool(body.return_tokens_as_token_ids)
        want_ids = bool(body.return_token_ids)
        k = body.logprobs or 0
        offsets = _TextOffsets(num_choices)
        out_tokens = [0] * num_choices
        shown = [self._echoed_bytes(body, ids, w) for ids, w in zip(prompts, whole)] if echo_k is not None else []

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
            acc = await self.gather(stream, num_choices, request)
            choices = []
            for i, c in enumerate(acc):
                if scoring:  # the token the engine ran is not the client's, nor why it ended: cut at 0 tokens
                    c = GatheredChoice(finish_reason="length")
                out_tokens[i] = c.num_tokens
                prompt_lps = acc[i - i % body.n].prompt_logprobs  # the prompt's first choice asked for them
                lp = None
                if want_lp:
                    head = echo_rows(i, prompt_lps) if echo_k is not None else []
                    lp = self._completion_logprobs(head + self._rows(c.logprobs), offsets, i, as_ids)
                text = c.text if echoes is None else echoes[i // body.n] + c.text
                choices.append({"index": i, "text": text, "logprobs": lp, "finish_reason": c.finish_reason,
                                "stop_reason": c.stop_reason,
                                "prompt_logprobs": self.prompt_logprobs(prompt_lps, shown_k)})
                if want_ids:  # vLLM's return_token_ids
                    choices[-1] |= {"prompt_token_ids": prompts[i // body.n], "token_ids": c.token_ids}
            return JSONResponse({"id": rid, "object": "text_completion", "created": created, "model": model,
                                 "choices": choices, "usage": usage()}, headers={REPLICA_HEADER: stream.replica})

        unechoed = set(range(num_choices)) if echo_k is not None else set()
        # echo with logprobs: only the prompt's first choice computes its logprobs (the others share its prefix
        # cache); a choice's deltas wait for them, which come with that choice's first delta
        shared = _SharedPromptLogprobs(body.n) if echo_k is not None else None
        unsent_ids = set(range(num_choices)) if want_ids else set()

        def with_ids(i: int, choice: dict, token_ids: list[int]) -> dict:
            """return_token_ids: choice i's chunk with the ids it adds, and its prompt's with its first chunk."""
            if want_ids:
                choice["token_ids"] = token_ids
                if i in unsent_ids:
                    unsent_ids.discard(i)
                    choice["prompt_token_ids"] = prompts[i // body.n]
            return choice

        def frames(items: list[tuple[int, GenerationDelta]]) -> list[dict]:
            choices = []
            for i, d in items if shared is None else shared.ready(items):
                if scoring:  # one chunk per choice once its engine token is done: the prompt and its logprobs (vLLM)
                    if d.finished:
                        lp = (self._completion_logprobs(echo_rows(i, shared.of(i)), offsets, i, as_ids)
                              if want_lp else None)
                        choices.append(with_ids(i, {"index": i, "text": echoes[i // body.n], "logprobs": lp,
                                                    "finish_reason": "length", "stop_reason": None}, []))
                    continue
                out_tokens[i] = d.num_output_tokens
                if not d.text and not d.finished and not want_lp and not (want_ids and d.token_ids):
                    continue  # held back (stop-string prefix or incomplete character): nothing to say
                text, lp = d.text, None
                if i in unechoed:  # echo with logprobs: the prompt and its logprobs with the first token (vLLM)
                    unechoed.discard(i)
                    text = echoes[i // body.n] + text
                    lp = self._completion_logprobs(echo_rows(i, shared.of(i)) + self._rows(d.logprobs or []),
                                                   offsets, i, as_ids)
                elif want_lp:
                    lp = self._completion_logprobs(self._rows(d.logprobs or []), offsets, i, as_ids)
                choices.append(with_ids(i, {"index": i, "text": text, "logprobs": lp,
                                            "finish_reason": d.finish_reason if d.finished else None,
                                            "stop_reason": d.stop_reason}, d.token_ids))
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
                     "choices": [with_ids(i, {"index": i, "text": echoes[i // body.n], "logprobs": None,
                                              "finish_reason": None, "stop_reason": None}, [])
                                 for i in range(num_choices)]}]
        return self.sse(stream, frames, tail, head, usage if continuous_usage(body.stream_options) else None)

    async def _echo_texts(self, body: CompletionRequest, prompts: list[list[int]], whole: list[bool]) -> list[str]:
        """Each prompt's text for echo: as sent, or its token ids decoded (off the event loop); a text prompt that
        truncate_prompt_tokens cut, the ids the model ran decoded."""
        texts = _prompt_texts(body)
        decode = self.engine.tokenizer.decode
        return await asyncio.to_thread(lambda: [
            texts[i] if texts is not None and whole[i] else decode(p, skip_special_tokens=body.skip_special_tokens)
            for i, p in enumerate(prompts)])

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

    def _echoed_bytes(self, body: CompletionRequest, ids: list[int], whole: bool = True) -> list[bytes]:
        """Each prompt token's bytes in its echoed text: a text prompt is echoed as sent (without the BOS or EOS the
        tokenizer added), a prompt of ids, or a text prompt truncate_prompt_tokens cut (not `whole`), decoded (without
        its special tokens, unless skip_special_tokens is false)."""
        tok = self.engine.tokenizer
        data = [self.token_bytes(t) for t in ids]
        if whole and _prompt_texts(body) is not None:
            if tok.add_bos and tok.bos_token_id is not None:
                data[0] = b""
            if tok.meta.add_eos and tok.eos_token_ids:
                data[-1] = b""
            return data
        return [b"" if body.skip_special_tokens and tok.is_special(t) else b for t, b in zip(ids, data)]

    def _rows(self, lps: list[TokenLogprob]) -> list[_Row]:
        return [(t.token_id, finite(t.logprob), t.top, self.token_bytes(t.token_id)) for t in lps]

    def _completion_logprobs(self, rows: list[_Row], offsets: _TextOffsets, i: int, as_ids: bool = False) -> dict:
        """OpenAI's completions logprobs of choice i: tokens, logprobs, the k best (and the token) by text (the best
        logprob of the tokens sharing one), and where each token's text starts in the choice's text.
        as_ids: each token named "token_id:N" instead of by its text (vLLM's return_tokens_as_token_ids)."""
        tokens, values, tops, text_offset = [], [], [], []
        for token_id, value, top, data in rows:
            t = self.token_name(token_id, as_ids)
            tokens.append(t)
            text_offset.append(offsets.advance(i, data))
            if value is None:  # the prompt's first token: nothing before it to predict it (OpenAI, vLLM)
                values.append(None)
                tops.append(None)
                continue
            values.append(finite(value))
            # the k best and the token (vLLM; up to k + 1 entries); tokens sharing a text (byte fragments all read
            # "\ufffd") keep the highest logprob among them, never a lower one written over it
            best: dict[str, float] = {}
            for tid, v in [*(top or []), (token_id, value)]:
                key, v = self.token_name(tid, as_ids), finite(v)
                best[key] = max(v, best.get(key, v))
            tops.append(best)
        return {"tokens": tokens, "token_logprobs": values, "top_logprobs": tops, "text_offset": text_offset}


class _SharedPromptLogprobs:
    """A stream's prompt logprobs, asked of each prompt's first choice alone (choice_params): per prompt, those its
    first choice's first delta carried; the deltas of a prompt's other choices held until they came."""

    def __init__(self, n: int) -> None:
        self.n = n
        self.by_prompt: dict[int, list[TokenLogprob | None] | None] = {}
        self.held: dict[int, list[GenerationDelta]] = {}

    def ready(self, items: list[tuple[int, GenerationDelta]]) -> list[tuple[int, GenerationDelta]]:
        """The deltas whose prompt logprobs are known, in order: these items', and those held for them."""
        out = []
        for i, d in items:
            prompt = i // self.n
            if prompt in self.by_prompt:
                out.append((i, d))
            elif i % self.n:
                self.held.setdefault(i, []).append(d)
            else:
                self.by_prompt[prompt] = d.prompt_logprobs
                out.append((i, d))
                out += [(j, h) for j in range(i + 1, i + self.n) for h in self.held.pop(j, [])]
        return out

    def of(self, i: int) -> list[TokenLogprob | None] | None:
        """Choice i's prompt logprobs (None if its first choice ended with none)."""
        return self.by_prompt[i // self.n]


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


def _prompt_texts(body: CompletionRequest) -> list[str] | None:
    """The prompts' texts as sent; None for prompts of token ids."""
    if isinstance(body.prompt, str):
        return [body.prompt]
    return list(body.prompt) if isinstance(body.prompt[0], str) else None


def _num_prompts(prompt: str | list) -> int:
    """A string or one list of token ids is one prompt; a list of strings or of id lists is several."""
    return len(prompt) if isinstance(prompt, list) and prompt and not isinstance(prompt[0], int) else 1
