"""Shared fixtures: a tiny random-weight Llama built in-process, and the real default model."""

from __future__ import annotations

import os

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from tokenhaul.config import EngineConfig  # noqa: E402
from tokenhaul.engine.core import EngineCore  # noqa: E402
from tokenhaul.models.config import ModelConfig  # noqa: E402
from tokenhaul.models.llama import LlamaModel  # noqa: E402


def tiny_config(**kw) -> ModelConfig:
    base = dict(arch="llama", hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16,
                ffn_size=128, vocab_size=97, max_position=512, norm_eps=1e-5, rope_theta=10000.0,
                tie_embeddings=True)
    base.update(kw)
    return ModelConfig(**base)


def tiny_llama(seed: int = 0, **kw) -> LlamaModel:
    """Random weights with GGUF tensor names; scaled so logits are peaked (greedy is stable)."""
    cfg = tiny_config(**kw)
    g = torch.Generator().manual_seed(seed)

    def r(*shape, s=0.2):
        return torch.randn(*shape, generator=g) * s

    h, q, kv, f = cfg.hidden_size, cfg.q_size, cfg.kv_size, cfg.ffn_size
    w = {"token_embd.weight": r(cfg.vocab_size, h, s=1.0), "output_norm.weight": torch.ones(h)}
    for i in range(cfg.num_layers):
        p = f"blk.{i}."
        w |= {p + "attn_q.weight": r(q, h), p + "attn_k.weight": r(kv, h), p + "attn_v.weight": r(kv, h),
              p + "attn_output.weight": r(h, q), p + "ffn_gate.weight": r(f, h), p + "ffn_up.weight": r(f, h),
              p + "ffn_down.weight": r(h, f), p + "attn_norm.weight": torch.ones(h),
              p + "ffn_norm.weight": torch.ones(h)}
    return LlamaModel(cfg, w, cfg.max_position)


@pytest.fixture
def tiny_core():
    """Factory: EngineCore over a tiny random model with a chosen KV budget / batch limits."""

    def make(num_kv_blocks: int = 64, block_size: int = 4, **kw) -> EngineCore:
        cfg = EngineConfig(model="tiny", num_kv_blocks=num_kv_blocks, block_size=block_size, **kw)
        return EngineCore(cfg, tiny_llama())

    return make


@pytest.fixture(scope="session")
def smollm():
    from tokenhaul.llm import LLM

    return LLM("smollm2-135m")
