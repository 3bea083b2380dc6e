"""Server fixtures: servers over the scripted model (fast) and over the real SmolLM2-135M."""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import pytest
from serverkit import MODEL, ScriptModel, ServerThread, free_port, script_engine

from tokenhaul.config import EngineConfig
from tokenhaul.engine.core import EngineCore
from tokenhaul.server.app import build_app
from tokenhaul.server.async_engine import AsyncEngine


@pytest.fixture(scope="session")
def script_server(tokenizer) -> Iterator[tuple[str, AsyncEngine, ScriptModel]]:
    """(url, engine, model) of a server over the scripted model (context 256 tokens, 64 KV blocks)."""
    engine, model = script_engine(tokenizer)
    with ServerThread(build_app(engine)) as srv:
        yield srv.url, engine, model


@pytest.fixture(scope="session")
def real_server(smollm) -> Iterator[tuple[str, AsyncEngine]]:
    """(url, engine) of a server over SmolLM2-135M (sharing the session LLM's weights), 512 KV blocks."""
    cfg = EngineConfig(model=MODEL, dtype="fp32", num_kv_blocks=512, max_num_seqs=64)
    engine = AsyncEngine(EngineCore(cfg, smollm.model), smollm.tokenizer, MODEL)
    with ServerThread(build_app(engine)) as srv:
        yield srv.url, engine


@pytest.fixture
def client() -> Iterator[httpx.Client]:
    with httpx.Client(timeout=120.0) as c:
        yield c


@pytest.fixture
def unused_port() -> int:
    return free_port()
