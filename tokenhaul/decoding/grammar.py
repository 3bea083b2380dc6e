"""Structured outputs in the engine: one llguidance matcher per constrained request (Grammar), built by the
GrammarCompiler from the model's tokenizer, and the mask that sets each constrained row's disallowed tokens to
-inf before anything else reads the logits (vLLM applies the grammar bitmask before its sampler).

Rows of unconstrained requests are left bit for bit as they were. The scheduler feeds each appended token to
the request's matcher once (engine/scheduler.py), so recompute after preemption never feeds it twice."""

from __future__ import annotations

import json
import logging
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import torch
from llguidance import LLMatcher, LLTokenizer, TokenizerWrapper
from tokenizers import Tokenizer as Backend

from tokenhaul.engine.request import Request
from tokenhaul.errors import RequestError, TokenhaulError
from tokenhaul.structured_outputs import StructuredOutputsParams

if TYPE_CHECKING:
    from tokenhaul.text.tokenizer import Tokenizer

_BITS = torch.arange(32, dtype=torch.int32)
log = logging.getLogger(__name__)


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
        if not self.matcher.consume_token(token):
            log.warning("structured output refused token %d: %s", token, _one_line(self.matcher.get_error()))

    @property
    def complete(self) -> bool:
        """Nothing but EOS may follow: the output is complete."""
        return self.matcher.is_stopped() and not self.matcher.is_error()

    @property
    def failed(self) -> bool:
        """The matcher refused a token: the output no longer meets the constraint."""
        return self.matcher.is_error()


class GrammarCompiler:
    """Builds each constrained request's Grammar over llguidance's token table (LLTokenizer), built once per
    compiler: by `warm()` if the engine calls it, else on the first constrained request. `load` gives the
    tokenizer: a `tokenizers.Tokenizer` (or its JSON string) and the EOS ids.

    The table is built from the token strings (_token_table: the bytes llguidance's own tokenizer.json reader
    derives, without it parsing the whole JSON again: that took ~60% of the build on Gemma3's 262k vocabulary), and
    llguidance tokenizes forced text with the `tokenizers` model itself (_Encode), as that reader does; tokenizers
    the table does not read that way are handed to the reader (_json_tokenizer)."""

    def __init__(self, load: Callable[[], tuple[Backend | str, Sequence[int]]], vocab_size: int) -> None:
        self._load = load
        self.vocab_size = vocab_size
        self._tokenizer: LLTokenizer | None = None

    @classmethod
    def for_model(cls, model: str, vocab_size: int) -> GrammarCompiler:
        """The compiler of a catalog alias or GGUF path: its tokenizer is read on first use."""
        def load() -> tuple[Backend, Sequence[int]]:
            from tokenhaul.models.catalog import resolve
            from tokenhaul.text.tokenizer import Tokenizer

            files = resolve(model)
            tokenizer = Tokenizer.from_gguf(files.gguf_path, files.cache_dir, files.name)
            return tokenizer.backend, tokenizer.eos_token_ids

        return cls(load, vocab_size)

    @classmethod
    def for_tokenizer(cls, tokenizer: Tokenizer, vocab_size: int) -> GrammarCompiler:
        """The compiler over a tokenizer already loaded (LLM's): not read from the model's file again."""
        return cls(lambda: (tokenizer.backend, tokenizer.eos_token_ids), vocab_size)

    def warm(self) -> None:
        """Build the token table now (at model load) rather than inside the first constrained request's step. A
        tokenizer llguidance cannot take does not stop the load: constrained requests are refused with the reason."""
        try:
            self.tokenizer()
        except RequestError:
            pass

    def tokenizer(self) -> LLTokenizer:
        if self._tokenizer is None:
            try:
                self._tokenizer = self._build()
            except (TokenhaulError, ValueError) as e:  # llguidance: ValueError
                raise RequestError(f"structured outputs need the model's tokenizer: {_one_line(str(e))}") from None
        return self._tokenizer

    def _build(self) -> LLTokenizer:
        backend, eos = self._load()
        if isinstance(backend, str):
            backend = Backend.from_str(backend)
        n = backend.get_vocab_size(with_added_tokens=True)
        if n > self.vocab_size:
            raise ValueError(f"it has {n} tokens, the model {self.vocab_size}")
        eos = list(eos)
        tokens = _token_table(backend, self.vocab_size) if eos else None
        if tokens is None:  # a vocabulary _token_table does not read as llguidance would: its own reader
            return _json_tokenizer(backend, self.vocab_size, eos)
        return LLTokenizer(_Encode(backend, eos, tokens), eos_token=eos)

    def compile(self, params: StructuredOutputsParams) -> Grammar:
        """A fresh matcher for one request; raises RequestError (one line) if the grammar does not compile."""
        matcher = LLMatcher(self.tokenizer(), params.spec, log_level=0)
        if matcher.is_error():
            raise RequestError(f"structured_outputs.{params.kind} is invalid: {_one_line(matcher.get_error())}")
        return Grammar(matcher)


def _one_line(msg: str) -> str:
    return " ".join(msg.split())[:300]


def _json_tokenizer(backend: Backend, n_vocab: int, eos: list[int]) -> LLTokenizer:
    """llguidance's own tokenizer.json reader (toktrie_hf_tokenizers): the reference for _token_table and _Encode."""
    return LLTokenizer(backend.to_str(), n_vocab=n_vocab, eos_token=eos)


class _Encode(TokenizerWrapper):
    """The tokenizer LLTokenizer takes from Python (TokenizerWrapper's attributes): the token table, EOS, and
    `__call__` (text → ids; llguidance tokenizes forced text with it while computing masks): the `tokenizers`
    model's encoding, as llguidance's own reader calls it (`encode(text, add_special_tokens=False)`), except that
    text spelling a special token ("<tool_call>", "<|im_start|>") stays text: the table marks special tokens
    (0xFF first) so no grammar accepts them, and a forced special token left the matcher in error."""

    def __init__(self, backend: Backend, eos: list[int], tokens: list[bytes]) -> None:
        # not TokenizerWrapper.__init__, which wraps another tokenizer object: the attributes LLTokenizer reads
        self.is_tokenizer_wrapper = True
        self.tokens = tokens
        self.eos_token_id = eos[0]
        self.bos_token_id = None
        self.special_token_ids: list[int] = []  # the table marks them itself (0xFF first)
        self._backend = backend
        self._marked = frozenset(i for i, t in enumerate(tokens) if t.startswith(_SPECIAL))

    def __call__(self, text: str) -> list[int]:
        enc = self._backend.encode(text, add_special_tokens=False)
        if self._marked.isdisjoint(enc.ids):
            return enc.ids
        return [t for i, (start, end) in zip(enc.ids, enc.offsets)
                for t in (self._plain(text[start:end]) if i in self._marked else (i,))]

    def _plain(self, text: str) -> list[int]:
        """text through normalizer, pre-tokenizer and model, none of the added tokens matched."""
        b = self._backend
        text = b.normalizer.normalize_str(text) if b.normalizer else text
        pieces = b.pre_tokenizer.pre_tokenize_str(text) if b.pre_tokenizer else [(text, None)]
        return [t.id for piece, _ in pieces for t in b.model.tokenize(piece)]


_SPECIAL = b"\xff"  # llguidance's TokTrie::SPECIAL_TOKEN_MARKER, first byte of a special token's entry
# GPT-2's byte-level alphabet (bytes_to_unicode) as a translate table: each character → its byte; any other
# character below 256 → U+0100, so that encoding the result as Latin-1 fails exactly where one is outside it
_PRINTABLE = [*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
_BYTE_LEVEL = {c: 0x100 for c in range(256)} | {c: c for c in _PRINTABLE} | {
    0x100 + k: b for k, b in enumerate(b for b in range(256) if b not in set(_PRINTABLE))}
_HEX = frozenset("0123456789abcdefABCDEF")


def _decoder_kind(d: dict) -> tuple[bool, bool, str | None]:
    """(byte fallback, byte level, the character a Replace decoder turns into " ") of a decoder's JSON."""
    kind = d.get("type")
    if kind == "ByteFallback":
        return True, False, None
    if kind == "ByteLevel":
        return False, True, None
    if kind == "Replace" and d.get("content") == " ":
        pattern = (d.get("pattern") or {}).get("String")
        return False, False, pattern if isinstance(pattern, str) and len(pattern) == 1 else None
    fallback = level = False
    space = None
    for sub in d.get("decoders") or () if kind == "Sequence" else ():
        f, lv, sp = _decoder_kind(sub)
        fallback, level, space = fallback or f, level or lv, sp if sp is not None else space
    return fallback, level, space


def _encodes_as_llguidance(backend: Backend) -> bool:
    """Whether the tokenizer encodes as llguidance's reader makes it: that drops Prepend normalizers and sets
    Metaspace pre-tokenizers to prepend nothing (no model in the catalog has either)."""
    def parts(obj: object) -> list[dict]:
        if obj is None:
            return []
        found, todo = [], [json.loads(obj.__getstate__())]
        while todo:
            d = todo.pop()
            found.append(d)
            todo.extend(d.get("normalizers") or d.get("pretokenizers") or ())
        return found

    return not any(d.get("type") == "Prepend" for d in parts(backend.normalizer)) and all(
        d.get("prepend_scheme") == "never" for d in parts(backend.pre_tokenizer) if d.get("type") == "Metaspace")


def _token_table(backend: Backend, n_vocab: int) -> list[bytes] | None:
    """Each token's bytes as llguidance's ByteTokenizer::from_tokenizer derives them from a tokenizer.json (special
    tokens — added tokens marked special or written <...> — as 0xFF + their name), padded to n_vocab with its
    placeholders 0xFF<[i]>; None where its derivation would fail or the vocabulary has an oddity it would stop at."""
    if backend.decoder is None or not _encodes_as_llguidance(backend):
        return None
    fallback, level, space = _decoder_kind(json.loads(backend.decoder.__getstate__()))
    if not (fallback or level):
        return None
    n = backend.get_vocab_size(with_added_tokens=True)
    tokens = [b""] * n
    specials = set()
    for i, added in backend.get_added_tokens_decoder().items():
        if i >= n:
            return None
        content = added.content
        if added.special or (content.startswith("<") and content.endswith(">")):
            specials.add(i)
        else:
            tokens[i] = content.encode()
    space = space or " "
    for i, name in enumerate(map(backend.id_to_token, range(n))):
        if name is None:
            continue
        if i in specials:
            tokens[i] = _SPECIAL + name.encode()
        elif fallback:
            if name.startswith("<0x"):
                if not (len(name) == 6 and name.endswith(">") and name[3] in _HEX and name[4] in _HEX):
                    return None  # llguidance asserts no other token starts so
                tokens[i] = bytes([int(name[3:5], 16)])
            else:
                tokens[i] = name.replace(space, " ").encode()
        else:
            try:  # a character outside the alphabet: llguidance skips the token (keeps its added text, or none)
                tokens[i] = name.translate(_BYTE_LEVEL).encode("latin-1")
            except UnicodeEncodeError:
                pass
    tokens.extend(_SPECIAL + f"<[{i}]>".encode() for i in range(n, n_vocab))
    return tokens


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
