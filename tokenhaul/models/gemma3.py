"""Gemma3 forward: QK-norm, sandwich norms, GeLU-tanh MLP, sliding-window local layers with their own
RoPE base, scaled embeddings, optional final soft-capping."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from tokenhaul.kv.cache import KVCache
from tokenhaul.layers.attention import AttentionMetadata, paged_attention
from tokenhaul.layers.linear import Linear, Part
from tokenhaul.layers.norm import RMSNorm
from tokenhaul.layers.quantization import LinearFactory
from tokenhaul.layers.rope import RotaryEmbedding
from tokenhaul.models.config import ModelConfig


class Gemma3Layer:
    def __init__(self, cfg: ModelConfig, w: dict[str, Part], i: int, make: LinearFactory) -> None:
        p = f"blk.{i}."
        eps = cfg.norm_eps
        self.sliding = cfg.is_sliding(i)
        self.qkv: Linear = make.linear(p + "qkv", [w[p + "attn_q.weight"], w[p + "attn_k.weight"],
                                                   w[p + "attn_v.weight"]])
        self.o: Linear = make.linear(p + "o", [w[p + "attn_output.weight"]])
        self.gate_up: Linear = make.linear(p + "gate_up", [w[p + "ffn_gate.weight"], w[p + "ffn_up.weight"]])
        self.down: Linear = make.linear(p + "down", [w[p + "ffn_down.weight"]])
        self.attn_norm = RMSNorm(w[p + "attn_norm.weight"], eps)
        self.post_attn_norm = RMSNorm(w[p + "post_attention_norm.weight"], eps)
        self.ffn_norm = RMSNorm(w[p + "ffn_norm.weight"], eps)
        self.post_ffn_norm = RMSNorm(w[p + "post_ffw_norm.weight"], eps)
        self.next_norm = self.attn_norm  # the norm after this layer's residual: the next layer's (or the final)
        self.q_norm = RMSNorm(w[p + "attn_q_norm.weight"], eps)
        self.k_norm = RMSNorm(w[p + "attn_k_norm.weight"], eps)


class Gemma3Model:
    def __init__(self, cfg: ModelConfig, w: dict[str, Part], max_model_len: int,
                 make: LinearFactory | None = None) -> None:
        self.config = cfg
        make = make or LinearFactory.for_tensors(w)
        self.embed = make.embedding(w["token_embd.weight"])
        self.layers = [Gemma3Layer(cfg, w, i, make) for i in range(cfg.num_layers)]
        self.norm = RMSNorm(w["output_norm.weight"], cfg.norm_eps)
        for layer, after in zip(self.layers, self.layers[1:]):
            layer.next_norm = after.attn_norm
        self.layers[-1].next_norm = self.norm
        self.lm_head: Linear = make.linear("output", [w.get("output.weight", self.embed.table)])
        dev = self.embed.device
        act = self.embed.dtype
        self.rope_global = RotaryEmbedding(cfg.head_dim, max_model_len, cfg.rope_theta, dev, act)
        self.rope_local = RotaryEmbedding(cfg.head_dim, max_model_len, cfg.rope_theta_local, dev, act)
        self.scale = cfg.query_scale or cfg.head_dim ** -0.5

    def forward(self, input_ids: torch.Tensor, meta: AttentionMetadata, kv: KVCache) -> torch.Tensor:
        """input_ids: [T] → final hidden states [T, hidden] (normed), in the activation dtype throughout."""
        cfg = self.config
        T = input_ids.shape[0]
        h = self.embed(input_ids) * cfg.embed_scale
        tables = {False: self.rope_global.tables(meta.positions), True: self.rope_local.tables(meta.positions)}
        x = self.layers[0].attn_norm(h)
        for i, layer in enumerate(self.layers):
            cos, sin = tables[layer.sliding]  # gathered once per step for each RoPE base
            q, k, v = layer.qkv(x).split([cfg.q_size, cfg.kv_size, cfg.kv_size], dim=-1)
            q = RotaryEmbedding.apply(layer.q_norm(q.view(T, cfg.num_heads, cfg.head_dim)), cos, sin)
            k = RotaryEmbedding.apply(layer.k_norm(k.view(T, cfg.num_kv_heads, cfg.head_dim)), cos, sin)
            v = v.view(T, cfg.num_kv_heads, cfg.head_dim)
            a = paged_attention(q.float(), k, v, kv.k[i], kv.v[i], meta, self.scale, sliding=layer.sliding)
            a = a.to(h.dtype)  # fp32 queries, as in llama.py
            h, x = layer.ffn_norm.add(h, layer.post_attn_norm(layer.o(a)))
            gate, up = layer.gate_up(x).chunk(2, dim=-1)
            h, x = layer.next_norm.add(h, layer.post_ffn_norm(layer.down(F.gelu(gate, approximate="tanh") * up)))
        return x

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = self.lm_head(hidden).float()
        cap = self.config.final_logit_softcap
        return logits if cap is None else torch.tanh(logits / cap) * cap
