"""Llama-family forward (SmolLM2, Llama, Qwen2 with QKV bias and untied output) over paged KV."""

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


class LlamaLayer:
    def __init__(self, cfg: ModelConfig, w: dict[str, Part], i: int, make: LinearFactory) -> None:
        p = f"blk.{i}."
        bias = None
        if cfg.qkv_bias:
            bias = torch.cat([w[p + "attn_q.bias"], w[p + "attn_k.bias"], w[p + "attn_v.bias"]])
        self.qkv: Linear = make.linear(p + "qkv", [w[p + "attn_q.weight"], w[p + "attn_k.weight"],
                                                   w[p + "attn_v.weight"]], bias)
        self.o: Linear = make.linear(p + "o", [w[p + "attn_output.weight"]])
        self.gate_up: Linear = make.linear(p + "gate_up", [w[p + "ffn_gate.weight"], w[p + "ffn_up.weight"]])
        self.down: Linear = make.linear(p + "down", [w[p + "ffn_down.weight"]])
        self.attn_norm = RMSNorm(w[p + "attn_norm.weight"], cfg.norm_eps)
        self.ffn_norm = RMSNorm(w[p + "ffn_norm.weight"], cfg.norm_eps)
        self.next_norm = self.attn_norm  # the norm after this layer's residual: the next layer's (or the final)


class LlamaModel:
    def __init__(self, cfg: ModelConfig, w: dict[str, Part], max_model_len: int,
                 make: LinearFactory | None = None) -> None:
        self.config = cfg
        make = make or LinearFactory.for_tensors(w)
        self.embed = make.embedding(w["token_embd.weight"])
        self.layers = [LlamaLayer(cfg, w, i, make) for i in range(cfg.num_layers)]
        self.norm = RMSNorm(w["output_norm.weight"], cfg.norm_eps)
        for layer, after in zip(self.layers, self.layers[1:]):
            layer.next_norm = after.attn_norm
        self.layers[-1].next_norm = self.norm
        self.lm_head: Linear = make.linear("output", [w.get("output.weight", self.embed.table)])
        self.rope = RotaryEmbedding(cfg.head_dim, max_model_len, cfg.rope_theta, self.embed.device, self.embed.dtype)
        self.scale = cfg.head_dim ** -0.5

    def forward(self, input_ids: torch.Tensor, meta: AttentionMetadata, kv: KVCache) -> torch.Tensor:
        """input_ids: [T] → final hidden states [T, hidden] (normed), in the activation dtype throughout."""
        cfg = self.config
        T, H, Hkv, D = input_ids.shape[0], cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        qk_size = cfg.q_size + cfg.kv_size
        cos, sin = self.rope.tables(meta.positions)  # once per step, shared by every layer
        h = self.embed(input_ids)  # the residual stream
        x = self.layers[0].attn_norm(h)
        for i, layer in enumerate(self.layers):
            qkv = layer.qkv(x)  # [T, (H + 2 Hkv) D]
            qk = self.rope.apply(qkv[:, :qk_size].view(T, H + Hkv, D), cos, sin)  # q and k in one call
            q, k = qk.split([H, Hkv], dim=1)
            v = qkv[:, qk_size:].view(T, Hkv, D)
            # fp32 queries: the bf16 SDPA kernel is ~2x slower on one query here, and not batch-invariant
            a = paged_attention(q.float(), k, v, kv.k[i], kv.v[i], meta, self.scale, sliding=False).to(h.dtype)
            h, x = layer.ffn_norm.add(h, layer.o(a))
            gate, up = layer.gate_up(x).chunk(2, dim=-1)
            h, x = layer.next_norm.add(h, layer.down(F.silu(gate) * up))
        return x

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden: [N, hidden] → logits [N, vocab] (fp32)."""
        return self.lm_head(hidden).float()
