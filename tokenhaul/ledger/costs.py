"""Analytic bytes and FLOPs per step, per tier — the one source of truth for every count printed."""

from __future__ import annotations

from dataclasses import dataclass

from tokenhaul.models.config import ModelConfig


@dataclass(frozen=True)
class ModelCosts:
    """Per-model constants, taken from the loaded tensors (so quantized layouts count right)."""

    config: ModelConfig
    layer_weight_bytes: int  # every linear of every layer, read once per step
    lm_head_bytes: int
    embed_row_bytes: int  # one embedding row
    norm_bytes: int
    kv_bytes_per_token: int  # K and V of one token, all layers
    layer_params: int  # multiply-adds per token through the layers' linears
    lm_head_params: int
    activation_itemsize: int = 4

    @classmethod
    def from_model(cls, model, kv_itemsize: int) -> ModelCosts:
        c = model.config
        layer_bytes = layer_params = 0
        norm_bytes = model.norm.weight.nbytes
        for layer in model.layers:
            for name, v in vars(layer).items():
                if hasattr(v, "weight_bytes"):
                    layer_bytes += v.weight_bytes
                    layer_params += v.in_features * v.out_features
                elif name.endswith("norm"):
                    norm_bytes += v.weight.nbytes
        embed = model.embed
        return cls(c, layer_bytes, model.lm_head.weight_bytes, embed.shape[1] * embed.element_size(),
                   norm_bytes, 2 * c.num_layers * c.num_kv_heads * c.head_dim * kv_itemsize,
                   layer_params, model.lm_head.in_features * model.lm_head.out_features)

    @property
    def weight_bytes_per_step(self) -> int:
        """Weights a step reads from memory: all layers, lm_head, norms (embedding rows separate)."""
        return self.layer_weight_bytes + self.lm_head_bytes + self.norm_bytes


@dataclass
class StepCosts:
    weight_bytes: int = 0
    kv_read_bytes: int = 0
    kv_write_bytes: int = 0
    activation_bytes: int = 0
    logits_bytes: int = 0
    flops: int = 0

    @property
    def total_bytes(self) -> int:
        return (self.weight_bytes + self.kv_read_bytes + self.kv_write_bytes + self.activation_bytes
                + self.logits_bytes)


def step_costs(mc: ModelCosts, chunks: list[tuple[int, int]], num_sampled: int) -> StepCosts:
    """chunks: (start position, tokens computed) per scheduled sequence."""
    c = mc.config
    T = sum(n for _, n in chunks)
    if T == 0:
        return StepCosts()
    kv_tok = mc.kv_bytes_per_token
    lm_head = mc.lm_head_bytes if num_sampled else 0
    weights = mc.layer_weight_bytes + mc.norm_bytes + lm_head + T * mc.embed_row_bytes
    kv_read = sum(start + n for start, n in chunks) * kv_tok
    kv_write = T * kv_tok
    act = T * c.hidden_size * mc.activation_itemsize * 2 * c.num_layers  # residual in/out per layer
    logits = num_sampled * c.vocab_size * 4
    linear_flops = 2 * T * mc.layer_params + 2 * num_sampled * mc.lm_head_params
    attn_flops = sum(4 * n * (start + n) * c.num_heads * c.head_dim for start, n in chunks) * c.num_layers
    return StepCosts(weights, kv_read, kv_write, act, logits, linear_flops + attn_flops)
