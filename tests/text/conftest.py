"""Fixtures for text/: a tiny in-memory byte-level tokenizer, and the three real vocabularies (built once)."""

from __future__ import annotations

import functools
import os
from collections.abc import Callable
from typing import Any

import pytest
from tokenizers import Tokenizer as Backend
from tokenizers import decoders, models, pre_tokenizers

from tokenhaul.models.catalog import is_installed, resolve
from tokenhaul.text.tokenizer import Tokenizer, TokenizerMeta

REAL_MODELS = ("smollm2-135m", "gemma3-270m", "qwen2.5-coder-0.5b")
TINY_SPECIALS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")


def make_tiny(chat_template: str | None = None) -> Tokenizer:
    """Byte-level BPE over the 256 byte symbols plus a few merges; specials at ids 256-258."""
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    vocab = {ch: i for i, ch in enumerate(alphabet)}
    merges = [("Ġ", "w"), ("o", "r"), ("Ġw", "or"), ("l", "d"), ("Ġwor", "ld")]
    for a, b in merges:
        vocab[a + b] = len(vocab)
    backend = Backend(models.BPE(vocab=vocab, merges=merges))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    backend.add_special_tokens(list(TINY_SPECIALS))
    specials = [backend.token_to_id(t) for t in TINY_SPECIALS]
    meta = TokenizerMeta(
        bos_token_id=specials[1],
        eos_token_ids=[specials[2], specials[0]],
        add_bos=False,
        add_eos=False,
        chat_template=chat_template,
        special_ids=specials,
        source={},
    )
    return Tokenizer(backend, meta, "tiny")


@pytest.fixture(scope="session")
def tiny() -> Tokenizer:
    return make_tiny()


@pytest.fixture(scope="session")
def tiny_factory() -> Callable[[str | None], Tokenizer]:
    return make_tiny


def require(alias: str) -> None:
    if not is_installed(alias):
        pytest.skip(f"model {alias} not installed")


@functools.cache
def _load(alias: str) -> Tokenizer:
    mf = resolve(alias)
    return Tokenizer.from_gguf(mf.gguf_path, mf.cache_dir, name=alias)


def _real(alias: str) -> Tokenizer:
    require(alias)
    return _load(alias)


@pytest.fixture(scope="session", params=REAL_MODELS)
def real_tok(request: pytest.FixtureRequest) -> Tokenizer:
    """Each real tokenizer, loaded once per session (the first build ever takes seconds)."""
    return _real(request.param)


@pytest.fixture(scope="session")
def real_toks() -> Callable[[str], Tokenizer]:
    """A getter: alias → its real tokenizer (skips if the model is not installed)."""
    return _real


@pytest.fixture(scope="session")
def hf_tok() -> Callable[[str], Any]:
    """A getter: alias → the transformers reference tokenizer (slow to build: cached per session)."""
    return _hf_tokenizer


@functools.cache
def _hf_tokenizer(alias: str) -> Any:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from transformers import AutoTokenizer

    p = resolve(alias).gguf_path
    return AutoTokenizer.from_pretrained(str(p.parent), gguf_file=p.name)
