"""/v1/chat/completions: messages rendered by the model's chat template (with the request's tools), n choices,
OpenAI's logprobs and vLLM's prompt_logprobs; tool calls read from the text as server/tools.py says; streamed as
SSE chunks or gathered into one response."""

from __future__ import annotations

import time
import uuid

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from tokenhaul.errors import RequestError, TokenhaulError
from tokenhaul.outputs import TokenLogprob
from tokenhaul.server.async_engine import AsyncEngine, GenerationDelta
from tokenhaul.server.chat_protocol import ChatCompletionRequest
from tokenhaul.server.errors import check_model, refused
from tokenhaul.server.serving import REPLICA_HEADER, OpenAIServing, continuous_usage, finite
from tokenhaul.server.tool_stream import ToolStream, choice_message
from tokenhaul.server.tools import read_tool_use, with_tools


class ChatHandler(OpenAIServing):
    """/v1/chat/completions; one instance per app."""

    def __init__(self, engine: AsyncEngine, tool_parser: str | None = None, exclude_tools_when_none: bool = False,
                 ) -> None:
        super().__init__(engine)
        self.tool_parser = tool_parser  # with --enable-auto-tool-choice: tool_choice "auto" is served by it
        self.exclude_tools_when_none = exclude_tools_when_none  # --exclude-tools-when-tool-choice-none

    async def chat(self, body: ChatCompletionRequest, request: Request) -> Response:
        e = self.engine
        check_model(e, body.model)
        try:
            body.check_unsupported()
            if body.top_logprobs is not None and not body.logprobs:
                raise RequestError("top_logprobs requires logprobs to be true")
            messages = [m.as_template_dict() for m in body.messages]
            tool_use = read_tool_use(body.tools, body.tool_choice, self.tool_parser)
            # the template gets the tools, with "none" too (vLLM's default) unless serve excludes them there
            shown = tool_use is not None and not (self.exclude_tools_when_none and tool_use.choice == "none")
            kwargs = with_tools(body.chat_template_kwargs, tool_use.tools if shown else None)
            prompt = await e.encode_chat(messages, body.add_generation_prompt, body.continue_final_message,
                                         template_kwargs=kwargs)
            prompt = self.truncate(body, prompt)  # vLLM's truncate_prompt_tokens: of the rendered prompt
            max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
            if max_tokens is None:  # null or left out (vLLM's default): up to the context's end
                max_tokens = self.room(len(prompt))
            lp = (body.top_logprobs or 0) if body.logprobs else None
            shown_k = None if body.stream else body.prompt_logprobs  # no stream chunk carries them (vLLM)
            params = body.choice_params(max_tokens, lp, shown_k, tool_schema=tool_use and tool_use.schema())
            await self.tokenize_bad_words(params)
        except TokenhaulError as err:
            raise refused(e, err, "messages") from None
        rid = f"chatcmpl-{uuid.uuid4().hex}"
        stream = self.admit([prompt] * len(params), params, rid, "messages")
        created, model = int(time.time()), e.model_name
        out_tokens = [0] * body.n
        want_lp = body.logprobs
        as_ids = bool(body.return_tokens_as_token_ids)
        want_ids = bool(body.return_token_ids)  # vLLM's: the prompt's and each choice's token ids

        def usage() -> dict:
            done = sum(out_tokens)
            return {"prompt_tokens": len(prompt), "completion_tokens": done, "total_tokens": len(prompt) + done}

        if not body.stream:
            acc = await self.gather(stream, body.n, request)
            choices = []
            for i, c in enumerate(acc):
                out_tokens[i] = c.num_tokens
                message, reason = ({"role": "assistant", "content": c.text}, c.finish_reason) if tool_use is None \
                    else choice_message(tool_use, c.text, c.finish_reason)
                choices.append({"index": i, "message": message,
                                "logprobs": {"content": self._chat_logprobs(c.logprobs, as_ids)} if want_lp else None,
                                "finish_reason": reason, "stop_reason": c.stop_reason})
                if want_ids:
                    choices[-1]["token_ids"] = c.token_ids
            response = {"id": rid, "object": "chat.completion", "created": created, "model": model,
                        "choices": choices, "usage": usage(),
                        "prompt_logprobs": self.prompt_logprobs(acc[0].prompt_logprobs, shown_k)}
            if want_ids:
                response["prompt_token_ids"] = prompt
            return JSONResponse(response, headers={REPLICA_HEADER: stream.replica})

        def chunk(choices: list[dict]) -> dict:
            return {"id": rid, "object": "chat.completion.chunk", "created": created, "model": model,
                    "choices": choices}

        head = [chunk([{"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                        "finish_reason": None} for i in range(body.n)])]
        if want_ids:
            head[0]["prompt_token_ids"] = prompt

        tool_streams = [ToolStream(tool_use) for _ in range(body.n)]

        def frames(items: list[tuple[int, GenerationDelta]]) -> list[dict]:
            choices = []
            for i, d in items:
                out_tokens[i] = d.num_output_tokens
                delta, reason = tool_streams[i].delta(d.text, d.finished, d.finish_reason)
                if not delta and not d.finished and not want_lp and not (want_ids and d.token_ids):
                    continue
                lp = {"content": self._chat_logprobs(d.logprobs or [], as_ids)} if want_lp else None
                choices.append({"index": i, "delta": delta, "logprobs": lp,
                                "finish_reason": reason if d.finished else None,
                                "stop_reason": d.stop_reason})
                if want_ids:
                    choices[-1]["token_ids"] = d.token_ids
            return [chunk(choices)] if choices else []

        def tail() -> list[dict]:
            if not (body.stream_options and body.stream_options.include_usage):
                return []
            return [chunk([]) | {"usage": usage()}]

        return self.sse(stream, frames, tail, head, usage if continuous_usage(body.stream_options) else None)

    def _chat_logprobs(self, lps: list[TokenLogprob], as_ids: bool = False) -> list[dict]:
        """OpenAI's chat logprobs entries; as_ids: tokens named "token_id:N" (vLLM's return_tokens_as_token_ids),
        their bytes still the token's own."""
        out = []
        for lp in lps:
            t = self.token_name(lp.token_id, as_ids)
            top = [{"token": self.token_name(tid, as_ids), "logprob": finite(v), "bytes": list(self.token_bytes(tid))}
                   for tid, v in (lp.top or [])]
            out.append({"token": t, "logprob": finite(lp.logprob), "bytes": list(self.token_bytes(lp.token_id)),
                        "top_logprobs": top})
        return out
