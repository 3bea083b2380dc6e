"""Cluster fixtures: the real tokenizer, and the server test kit (tests/server/serverkit.py)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "server"))

from serverkit import MODEL  # noqa: E402

from tokenhaul.models.catalog import is_installed, resolve  # noqa: E402
from tokenhaul.text.tokenizer import Tokenizer  # noqa: E402


@pytest.fixture(scope="session")
def tokenizer() -> Tokenizer:
    if not is_installed(MODEL):
        pytest.skip(f"model {MODEL} not installed")
    f = resolve(MODEL)
    return Tokenizer.from_gguf(f.gguf_path, f.cache_dir, MODEL)
