"""Tokenizer: a `tokenizers` backend built once from a GGUF, cached as tokenizer.json; chat templates."""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

import jinja2
from jinja2.ext import loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer as Backend
from tokenizers import decoders

from tokenhaul.atomic import atomic_path
from tokenhaul.errors import ModelError, RequestError
from tokenhaul.models.gguf_file import GGUFFile

META_VERSION = 1
END_OF_TURN_TOKENS = ("<|im_end|>", "<end_of_turn>", "<|endoftext|>", "<|eot_id|>", "<|eom_id|>")
_GGUF_KEYS = {
    "bos": "tokenizer.ggml.bos_token_id",
    "eos": "tokenizer.ggml.eos_token_id",
    "eot": "tokenizer.ggml.eot_token_id",
    "eom": "tokenizer.ggml.eom_token_id",
    "add_bos": "tokenizer.ggml.add_bos_token",
    "add_eos": "tokenizer.ggml.add_eos_token",
    "template": "tokenizer.chat_template",
}
@dataclass(frozen=True)
class TokenizerMeta:
    """What the GGUF says beyond the vocabulary; cached beside tokenizer.json."""

    bos_token_id: int | None
    eos_token_ids: list[int]  # GGUF eos first, then end-of-turn tokens found in the vocabulary
    add_bos: bool
    add_eos: bool
    chat_template: str | None
    special_ids: list[int]
    source: dict[str, int]  # size and mtime of the GGUF the cache was built from
    version: int = META_VERSION


class Tokenizer:
    """Encode / decode / chat-template for one model; `backend` is the `tokenizers.Tokenizer`."""

    def __init__(self, backend: Backend, meta: TokenizerMeta, name: str) -> None:
        self.backend = backend
        self.meta = meta
        self.name = name
        self.vocab_size: int = backend.get_vocab_size(with_added_tokens=True)
        self.bos_token_id = meta.bos_token_id
        self.eos_token_ids = list(meta.eos_token_ids)
        self.add_bos = meta.add_bos
        self.chat_template = meta.chat_template
        self.special_ids = frozenset(meta.special_ids)
        fallback = getattr(backend.model, "byte_fallback", False)
        byte_ids = (backend.token_to_id(f"<0x{b:02X}>") for b in range(256)) if fallback else ()
        # ids whose text is one raw byte: the decoder groups runs of them into UTF-8
        self.byte_fallback_ids = frozenset(i for i in byte_ids if i is not None)
        self._template: jinja2.Template | None = None
        self._added: dict[int, str] | None = None  # added tokens' text, read on the first token_bytes

    @classmethod
    def from_gguf(cls, gguf_path: Path, cache_dir: Path, name: str | None = None) -> Tokenizer:
        """Load from cache_dir; on first use (or if the GGUF changed) build with transformers and cache."""
        gguf_path, cache_dir = Path(gguf_path), Path(cache_dir)
        name = name or gguf_path.stem
        st = gguf_path.stat()
        source = {"size": st.st_size, "mtime_ns": st.st_mtime_ns}
        json_path, meta_path = cache_dir / "tokenizer.json", cache_dir / "tokenizer_meta.json"
        try:
            meta = TokenizerMeta(**json.loads(meta_path.read_text()))
            if meta.version == META_VERSION and meta.source == source:
                return cls(Backend.from_file(str(json_path)), meta, name)
        except Exception:  # missing, partial or stale cache: rebuild below
            pass
        backend, meta = _build(gguf_path, source)
        cache_dir.mkdir(parents=True, exist_ok=True)
        with atomic_path(json_path) as tmp:
            backend.save(str(tmp))
        with atomic_path(meta_path) as tmp:  # written last: marks the cache complete
            tmp.write_text(json.dumps(asdict(meta)))
        return cls(backend, meta, name)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of text; special-token strings in text become their ids; BOS/EOS as the GGUF says."""
        ids = self.backend.encode(text, add_special_tokens=False).ids
        if add_special_tokens:
            if self.add_bos and self.bos_token_id is not None:
                ids.insert(0, self.bos_token_id)
            if self.meta.add_eos and self.eos_token_ids:
                ids.append(self.eos_token_ids[0])
        return ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self.backend.decode(ids, skip_special_tokens=skip_special_tokens)

    def is_special(self, token_id: int) -> bool:
        return token_id in self.special_ids

    def token_text(self, token_id: int | None) -> str:
        """The vocabulary string of one id ('' for None or an unknown id)."""
        return (self.backend.id_to_token(token_id) or "") if token_id is not None else ""

    def token_bytes(self, token_id: int) -> bytes:
        """The bytes one id adds to decoded text: for byte-level and byte-fallback vocabularies possibly part of a
        UTF-8 character (OpenAI's logprobs `bytes`)."""
        if self._added is None:
            self._added = {i: t.content for i, t in self.backend.get_added_tokens_decoder().items()}
        text = self._added.get(token_id)
        if text is not None:
            return text.encode()
        piece = self.token_text(token_id)
        if token_id in self.byte_fallback_ids:  # "<0xAB>"
            return bytes([int(piece[3:5], 16)])
        if isinstance(self.backend.decoder, decoders.ByteLevel):
            try:
                return bytes(_BYTE_OF_CHAR[c] for c in piece)
            except KeyError:
                pass
        return piece.replace("\u2581", " ").encode()  # SentencePiece's word mark is a space

    def apply_chat_template(
        self, messages: list[dict], add_generation_prompt: bool = True, continue_final_message: bool = False,
        variables: dict[str, Any] | None = None
    ) -> str:
        """Render messages with the model's template (sandboxed jinja2), as transformers does, `variables` (vLLM's
        chat_template_kwargs, e.g. enable_thinking) visible to it; with continue_final_message the text ends where
        the last message's content does (no end-of-turn), so the model continues that message (transformers' tag
        method: mark the content's end, render, cut there). A developer message (OpenAI's role for its instructions)
        is rendered as a system one, as vLLM gives it to templates without the role (Qwen's would drop it)."""
        if self.chat_template is None:
            raise RequestError(f"model {self.name} has no chat template")
        messages = [{**m, "role": "system"} if m.get("role") == "developer" else m for m in messages]
        variables = variables or {}
        if taken := sorted(set(variables) & _TEMPLATE_ARGS):
            raise RequestError(f"chat_template_kwargs may not set {', '.join(taken)} (given by the request itself)")
        if continue_final_message:
            if add_generation_prompt:
                raise RequestError("continue_final_message and add_generation_prompt cannot both be true")
            if not messages:
                raise RequestError("continue_final_message needs a final message to continue")
            last = messages[-1]
            messages = [*messages[:-1], {**last, "content": (last.get("content") or "") + _CONTINUE_TAG}]
        if self._template is None:
            try:
                self._template = _jinja_env().from_string(self.chat_template)
            except jinja2.TemplateError as e:
                raise ModelError(f"model {self.name}: chat template does not compile: {e}") from None
        try:
            text = self._template.render(
                messages=messages,
                add_generation_prompt=add_generation_prompt,
                bos_token=self.token_text(self.bos_token_id),
                eos_token=self.token_text(self.eos_token_ids[0] if self.eos_token_ids else None),
                **{"tools": None, "documents": None, **variables},
            )
        except jinja2.TemplateError as e:
            raise RequestError(f"chat template of model {self.name}: {e}") from None
        except (TypeError, ValueError, AttributeError, KeyError, IndexError) as e:
            if not variables:  # the model's template on validated messages: a defect, not the request's
                raise
            raise RequestError(f"chat_template_kwargs: the chat template of model {self.name} failed on them: "
                               f"{type(e).__name__}: {e}") from None
        if not continue_final_message:
            return text
        at = text.rfind(_CONTINUE_TAG.strip())
        if at < 0:
            raise RequestError(f"continue_final_message: the chat template of model {self.name} does not render the "
                               f"final message's content")
        return text[:at] if text.startswith(_CONTINUE_TAG, at) else text[:at].rstrip()  # the template may trim


_TEMPLATE_ARGS = {"messages", "add_generation_prompt", "continue_final_message", "bos_token", "eos_token"}
_CONTINUE_TAG = "CONTINUE_FINAL_MESSAGE_TAG "  # transformers' mark of where the final message's content ends


def _byte_of_char() -> dict[str, int]:
    """GPT-2's byte-level alphabet reversed: each byte is a printable character in vocabulary strings."""
    kept = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    moved = [b for b in range(256) if b not in kept]
    return {chr(b): b for b in kept} | {chr(256 + n): b for n, b in enumerate(moved)}


_BYTE_OF_CHAR = _byte_of_char()


def _raise_exception(message: str) -> None:
    raise jinja2.TemplateError(message)


def _tojson(x: Any, ensure_ascii: bool = False, indent: int | None = None, **kwargs: Any) -> str:
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, **kwargs)


def _jinja_env() -> jinja2.Environment:
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env


@contextlib.contextmanager
def _offline() -> Iterator[None]:
    """No hub access and no transformers chatter while building from a local GGUF."""
    import huggingface_hub.constants as hub
    from transformers.utils import logging as hf_logging

    saved_env = {k: os.environ.get(k) for k in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE")}
    saved_flag, saved_level = hub.HF_HUB_OFFLINE, hf_logging.get_verbosity()
    os.environ.update(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    hub.HF_HUB_OFFLINE = True
    hf_logging.set_verbosity_error()
    try:
        yield
    finally:
        for k, v in saved_env.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        hub.HF_HUB_OFFLINE = saved_flag
        hf_logging.set_verbosity(saved_level)


def _build(gguf_path: Path, source: dict[str, int]) -> tuple[Backend, TokenizerMeta]:
    """The slow path (seconds): transformers converts the GGUF vocabulary to a fast tokenizer."""
    fields = GGUFFile(gguf_path, tensors=False).metadata
    get = {k: fields.get(key) for k, key in _GGUF_KEYS.items()}
    with _offline():
        from transformers import AutoTokenizer

        try:
            hf = AutoTokenizer.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)
        except Exception as e:  # transformers raises many kinds for an unsupported vocabulary
            why = (str(e).splitlines() or [type(e).__name__])[0]
            raise ModelError(f"{gguf_path.name}: cannot build a tokenizer: {why}") from None
    backend: Backend = hf.backend_tokenizer
    added = backend.get_added_tokens_decoder()
    special = sorted(i for i, tok in added.items() if tok.special)
    special_set = set(special)
    eos = [get[k] for k in ("eos", "eot", "eom") if get[k] is not None]
    eos += [i for t in END_OF_TURN_TOKENS if (i := backend.token_to_id(t)) is not None and i in special_set]
    bos = get["bos"]
    add_bos = get["add_bos"] if get["add_bos"] is not None else getattr(hf, "add_bos_token", False)
    meta = TokenizerMeta(
        bos_token_id=int(bos) if bos is not None else None,
        eos_token_ids=[int(i) for i in dict.fromkeys(eos)],
        add_bos=bool(add_bos) and bos is not None,
        add_eos=bool(get["add_eos"]),
        chat_template=get["template"] or None,
        special_ids=special,
        source=source,
    )
    return backend, meta
