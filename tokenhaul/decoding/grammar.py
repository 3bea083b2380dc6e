"""Structured outputs in the engine: one llguidance matcher per constrained request (Grammar), built by the
GrammarCompiler from the model's tokenizer, and the mask that sets each constrained row's disallowed tokens to
-inf before anything else reads the logits (vLLM applies the grammar bitmask before its sampler).

Rows of unconstrained requests are left bit for bit as they were. The scheduler feeds each appended token to
the request's matcher once (engine/scheduler.py), so recompute after preemption never feeds it twice."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import torch
from llguidance import LLMatcher, LLTokenizer

from tokenhaul.engine.request import Request
from tokenhaul.errors import RequestError, TokenhaulError
from tokenhaul.structured_outputs import StructuredOutputsParams

if TYPE_CHECKING:
    from tokenhaul.text.tokenizer import Tokenizer

_BITS = torch.arange(32, dtype=torch.int32)


class Grammar:
    """A request's matcher: the tokens allowed next, and the tokens accepted so far (each exactly once)."""

    def __init__(self, matcher: LLMatcher) -> None:
        self.matcher = matcher

    def fill_bitmask(self, row: torch.Tensor) -> None:
        """Write the allowed-token bitmask into row (int32 [ceil(V / 32)], CPU, contiguous): bit t % 32 of word
        t // 32 is set where token t may come next."""
        self.matcher.unsafe_compute_mask_ptr(row.data_ptr(), row.numel() * row.element_size())

    def accept(self, token: int) -> None:
        """Advance past a sampled token (masked sampling only draws allowed ones)."""
        self.matcher.consume_token(token)

    @property
    def terminated(self) -> bool:
        """Nothing but EOS may follow (the output is complete), or the matcher failed."""
        return self.matcher.is_stopped() or self.matcher.is_error()


class GrammarCompiler:
    """Builds each constrained request's Grammar. `load` gives the tokenizer (a `tokenizers` JSON string and the
    EOS ids); it is called, and llguidance's token table built (~0.2 s), on the first constrained request."""

    def __init__(self, load: Callable[[], tuple[str, Sequence[int]]], vocab_size: int) -> None:
        self._load = load
        self.vocab_size = vocab_size
        self._tokenizer: LLTokenizer | None = None

    @classmethod
    def for_model(cls, model: str, vocab_size: int) -> GrammarCompiler:
        """The compiler of a catalog alias or GGUF path: its tokenizer is read on first use."""
        def load() -> tuple[str, Sequence[int]]:
            from tokenhaul.models.catalog import resolve
            from tokenhaul.text.tokenizer import Tokenizer

            files = resolve(model)
            return _tokenizer_json(Tokenizer.from_gguf(files.gguf_path, files.cache_dir, files.name))

        return cls(load, vocab_size)

    @classmethod
    def for_tokenizer(cls, tokenizer: Tokenizer, vocab_size: int) -> GrammarCompiler:
        """The compiler over a tokenizer already loaded (LLM's): not read from the model's file again."""
        return cls(lambda: _tokenizer_json(tokenizer), vocab_size)

    def tokenizer(self) -> LLTokenizer:
        if self._tokenizer is None:
            try:
                text, eos = self._load()
            except TokenhaulError as e:
                raise RequestError(f"structured outputs need the model's tokenizer: {e}") from None
            tok = LLTokenizer(text, n_vocab=self.vocab_size, eos_token=list(eos))
            if tok.vocab_size > self.vocab_size:
                raise RequestError(f"structured outputs need the model's tokenizer: it has {tok.vocab_size} tokens, "
                                   f"the model {self.vocab_size}")
            self._tokenizer = tok
        return self._tokenizer

    def compile(self, params: StructuredOutputsParams) -> Grammar:
        """A fresh matcher for one request; raises RequestError (one line) if the grammar does not compile."""
        matcher = LLMatcher(self.tokenizer(), params.spec, log_level=0)
        if matcher.is_error():
            raise RequestError(f"structured_outputs.{params.kind} is invalid: "
                               f"{' '.join(matcher.get_error().split())[:300]}")
        return Grammar(matcher)


def _tokenizer_json(tokenizer: Tokenizer) -> tuple[str, Sequence[int]]:
    return tokenizer.backend.to_str(), tokenizer.eos_token_ids


def mask_logits(logits: torch.Tensor, reqs: Sequence[Request]) -> torch.Tensor:
    """logits [R, V], one row per request → the same, with each constrained request's row masked to its allowed
    tokens (-inf elsewhere). Returns the input itself when no row is constrained; never changes the input."""
    rows = [i for i, r in enumerate(reqs) if r.grammar is not None]
    if not rows:
        return logits
    V = logits.shape[-1]
    bits = torch.zeros(len(rows), -(-V // 32), dtype=torch.int32)
    for j, i in enumerate(rows):
        reqs[i].grammar.fill_bitmask(bits[j])
    allowed = ((bits[:, :, None] >> _BITS) & 1).reshape(len(rows), -1)[:, :V].bool().to(logits.device)
    index = torch.tensor(rows, device=logits.device)
    masked = logits[index].masked_fill(~allowed, float("-inf"))
    return logits.index_copy(0, index, masked)
