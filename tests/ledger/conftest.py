"""Fixtures for ledger/: tiny random Llama and Gemma3 engines with a Ledger attached."""

from __future__ import annotations

import pytest
import torch
from tiny_models import tiny_model

from tokenhaul.config import EngineConfig
from tokenhaul.engine.core import EngineCore
from tokenhaul.ledger.costs import ModelCosts
from tokenhaul.ledger.ledger import Ledger


@pytest.fixture
def ledger_core():
    """Factory: (EngineCore with a Ledger attached, the Ledger) over a tiny random model. One thread:
    tiny ops on two spinning OpenMP threads crawl when the machine is shared."""

    def make(arch: str = "llama", dtype: str = "fp32", num_kv_blocks: int = 64, block_size: int = 4, **kw):
        cfg = EngineConfig(model="tiny", dtype=dtype, num_kv_blocks=num_kv_blocks, block_size=block_size, **kw)
        model = tiny_model(arch, cfg.torch_dtype)
        core = EngineCore(cfg, model)
        core.observer = Ledger(ModelCosts.from_model(model, cfg.torch_dtype.itemsize, cfg.deterministic))
        return core, core.observer

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield make
    torch.set_num_threads(threads)
