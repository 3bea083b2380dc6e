"""Tiny random-weight models with GGUF tensor names, built in-process for fast unit tests."""

from __future__ import annotations

import torch

from tokenhaul.models.config import ModelConfig
from tokenhaul.models.gemma3 import Gemma3Model
from tokenhaul.models.llama import LlamaModel


def tiny_model(arch: str = "llama", dtype: torch.dtype = torch.float32, seed: int = 0, make=None, **kw):
    """`make`: a LinearFactory (layers/quantization.py) to build packed linears; default dense."""
    base = dict(arch=arch, hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16,
                ffn_size=96, vocab_size=97, max_position=512, norm_eps=1e-5, rope_theta=10000.0,
                tie_embeddings=True)
    if arch == "gemma3":
        base |= dict(sliding_window=6, sliding_pattern=2, query_scale=0.25, embed_scale=8.0)
    if arch == "qwen2":  # Llama's forward with a QKV bias
        base |= dict(qkv_bias=True)
    cfg = ModelConfig(**(base | kw))
    g = torch.Generator().manual_seed(seed)

    def r(*shape):
        return (torch.randn(*shape, generator=g) * 0.2).to(dtype)

    h, q, kv, f, d = cfg.hidden_size, cfg.q_size, cfg.kv_size, cfg.ffn_size, cfg.head_dim
    w = {"token_embd.weight": r(cfg.vocab_size, h), "output_norm.weight": torch.ones(h)}
    for i in range(cfg.num_layers):
        p = f"blk.{i}."
        w |= {p + "attn_q.weight": r(q, h), p + "attn_k.weight": r(kv, h), p + "attn_v.weight": r(kv, h),
              p + "attn_output.weight": r(h, q), p + "ffn_gate.weight": r(f, h), p + "ffn_up.weight": r(f, h),
              p + "ffn_down.weight": r(h, f), p + "attn_norm.weight": torch.ones(h),
              p + "ffn_norm.weight": torch.ones(h)}
        if cfg.qkv_bias:
            w |= {p + "attn_q.bias": r(q), p + "attn_k.bias": r(kv), p + "attn_v.bias": r(kv)}
        if arch == "gemma3":
            w |= {p + "post_attention_norm.weight": torch.ones(h), p + "post_ffw_norm.weight": torch.ones(h),
                  p + "attn_q_norm.weight": torch.ones(d), p + "attn_k_norm.weight": torch.ones(d)}
    cls = Gemma3Model if arch == "gemma3" else LlamaModel
    return cls(cfg, w, cfg.max_position, make)
