"""Shared fixtures: an engine over a tiny random-weight Llama, and the real default model."""

from __future__ import annotations

import os

import pytest
from hypothesis import settings

# property tests draw the same examples every run (CI cannot fail by the luck of the draw); to hunt with fresh
# random examples: HYPOTHESIS_PROFILE=explore
settings.register_profile("ci", derandomize=True)
settings.register_profile("explore", derandomize=False)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENHAUL_COMPILE", "off")  # LLM()/CLI default auto compiles in the background: tests opt in

from tiny_models import tiny_model  # noqa: E402

from tokenhaul.config import EngineConfig  # noqa: E402
from tokenhaul.engine.core import EngineCore  # noqa: E402


@pytest.fixture
def tiny_core():
    """Factory: EngineCore over a tiny random model with a chosen KV budget / batch limits."""

    def make(num_kv_blocks: int = 64, block_size: int = 4, **kw) -> EngineCore:
        cfg = EngineConfig(model="tiny", num_kv_blocks=num_kv_blocks, block_size=block_size, **({"dtype": "fp32"} | kw))
        return EngineCore(cfg, tiny_model())

    return make


@pytest.fixture(scope="session")
def tokenizer():
    """The default real model's tokenizer (server and cluster tests); skips if it is not installed."""
    from tokenhaul.models.catalog import is_installed, resolve
    from tokenhaul.text.tokenizer import Tokenizer

    if not is_installed("smollm2-135m"):
        pytest.skip("model smollm2-135m not installed")
    f = resolve("smollm2-135m")
    return Tokenizer.from_gguf(f.gguf_path, f.cache_dir, "smollm2-135m")


@pytest.fixture(scope="session")
def smollm():
    from tokenhaul.llm import LLM

    return LLM("smollm2-135m", dtype="fp32")  # exact comparisons (batch invariance, parity) need fp32
