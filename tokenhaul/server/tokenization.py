"""vLLM's /tokenize and /detokenize: the front end's tokenizer, text ↔ token ids; the engine is not asked.
A chat is rendered and tokenized as /v1/chat/completions does, so its count is that call's prompt_tokens."""

from __future__ import annotations

import asyncio

from tokenhaul.errors import TokenhaulError
from tokenhaul.server.async_engine import AsyncEngine
from tokenhaul.server.errors import APIError, check_model, refused
from tokenhaul.server.tokenize_protocol import DetokenizeRequest, TokenizeChatRequest, TokenizeCompletionRequest
from tokenhaul.server.tools import read_tools, with_tools


class TokenizationHandlers:
    """The two tokenizer endpoints; one instance per app."""

    def __init__(self, engine: AsyncEngine) -> None:
        self.engine = engine

    async def tokenize(self, body: TokenizeCompletionRequest | TokenizeChatRequest) -> dict:
        """A prompt's or a chat's token ids, their count and the model's context length (and with
        return_token_strs each token's vocabulary string; else null, as vLLM)."""
        e = self.engine
        check_model(e, body.model)
        chat = isinstance(body, TokenizeChatRequest)
        try:
            if chat:
                messages = [m.as_template_dict() for m in body.messages]
                tools = None if body.tools is None else read_tools(body.tools)  # as chat completions (vLLM)
                kwargs = with_tools(body.chat_template_kwargs, tools)
                ids = await e.encode_chat(messages, body.add_generation_prompt, body.continue_final_message,
                                          body.add_special_tokens, kwargs)
            else:
                ids = await e.encode(body.prompt, body.add_special_tokens)
        except TokenhaulError as err:
            raise refused(e, err, "messages" if chat else "prompt") from None
        strs = [e.tokenizer.token_text(t) for t in ids] if body.return_token_strs else None
        return {"count": len(ids), "max_model_len": e.limits.max_model_len, "tokens": ids, "token_strs": strs}

    async def detokenize(self, body: DetokenizeRequest) -> dict:
        """The text of token ids, special tokens included (as vLLM); an id outside the vocabulary is a 400."""
        e = self.engine
        check_model(e, body.model)
        size = e.tokenizer.vocab_size
        bad = next((t for t in body.tokens if not 0 <= t < size), None)
        if bad is not None:
            e.metrics.rejected.labels("invalid").inc()
            raise APIError(400, f"tokens contains token id {bad}, outside the vocabulary [0, {size})", param="tokens")
        text = await asyncio.to_thread(e.tokenizer.decode, body.tokens, False)
        return {"prompt": text}
