"""ModelConfig: the architecture facts a forward pass needs, read from GGUF metadata."""

from __future__ import annotations

import math
from dataclasses import dataclass

from tokenhaul.errors import ModelError

SUPPORTED_ARCHS = ("llama", "qwen2", "gemma3")


@dataclass(frozen=True)
class ModelConfig:
    arch: str
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    ffn_size: int
    vocab_size: int
    max_position: int
    norm_eps: float
    rope_theta: float
    tie_embeddings: bool
    qkv_bias: bool = False
    # Gemma3 only
    rope_theta_local: float = 10_000.0
    sliding_window: int | None = None
    sliding_pattern: int = 0  # every Nth layer (1-based) is global; 0 = all global
    query_scale: float | None = None  # softmax scale; None → 1/sqrt(head_dim)
    embed_scale: float = 1.0
    final_logit_softcap: float | None = None

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    def is_sliding(self, layer: int) -> bool:
        """Gemma3: layers are local (sliding window) except every `sliding_pattern`-th."""
        return self.sliding_window is not None and self.sliding_pattern > 0 and (
            (layer + 1) % self.sliding_pattern != 0
        )


def config_from_metadata(meta: dict, tensor_names: set[str]) -> ModelConfig:
    """Build a ModelConfig from GGUF key/values; raise ModelError for unsupported architectures."""
    arch = meta.get("general.architecture")
    if arch not in SUPPORTED_ARCHS:
        raise ModelError(f"unsupported architecture '{arch}' (supported: {', '.join(SUPPORTED_ARCHS)})")

    def get(key: str, default=None):
        val = meta.get(f"{arch}.{key}", default)
        if val is None:
            raise ModelError(f"GGUF metadata lacks '{arch}.{key}'")
        return val

    hidden = int(get("embedding_length"))
    heads = int(get("attention.head_count"))
    head_dim = int(meta.get(f"{arch}.attention.key_length") or meta.get(f"{arch}.rope.dimension_count")
                   or hidden // heads)
    vocab = int(meta.get(f"{arch}.vocab_size") or len(meta.get("tokenizer.ggml.tokens", [])))
    common = dict(
        arch=arch,
        hidden_size=hidden,
        num_layers=int(get("block_count")),
        num_heads=heads,
        num_kv_heads=int(get("attention.head_count_kv", heads)),
        head_dim=head_dim,
        ffn_size=int(get("feed_forward_length")),
        vocab_size=vocab,
        max_position=int(get("context_length")),
        norm_eps=float(get("attention.layer_norm_rms_epsilon")),
        rope_theta=float(get("rope.freq_base", 10_000.0)),
        tie_embeddings="output.weight" not in tensor_names,
        qkv_bias="blk.0.attn_q.bias" in tensor_names,
    )
    if arch == "gemma3":
        common.update(
            sliding_window=int(get("attention.sliding_window")),
            sliding_pattern=6,
            query_scale=1.0 / math.sqrt(head_dim),  # query_pre_attn_scalar = head_dim for Gemma3
            embed_scale=math.sqrt(hidden),
            final_logit_softcap=meta.get(f"{arch}.final_logit_softcapping"),
        )
    return ModelConfig(**common)
