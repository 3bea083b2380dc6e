"""Architecture registry: GGUF `general.architecture` → model class; `load_model` is the one entry."""

from __future__ import annotations

from pathlib import Path
from typing import Protocol

import torch

from tokenhaul.kv.cache import KVCache
from tokenhaul.layers.attention import AttentionMetadata
from tokenhaul.layers.quantization import LinearFactory, QuantSpec
from tokenhaul.layers.weight_block import gather_weights
from tokenhaul.models.config import ModelConfig
from tokenhaul.models.gemma3 import Gemma3Model
from tokenhaul.models.gguf import load_gguf
from tokenhaul.models.llama import LlamaModel
from tokenhaul.models.weight_cache import WeightCache


class Model(Protocol):
    config: ModelConfig

    def forward(self, input_ids: torch.Tensor, meta: AttentionMetadata, kv: KVCache) -> torch.Tensor: ...

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor: ...


ARCHITECTURES: dict[str, type] = {"llama": LlamaModel, "qwen2": LlamaModel, "gemma3": Gemma3Model}


def load_model(gguf_path, dtype: torch.dtype, device: str, max_model_len: int | None = None,
               quantization: str = "auto", cache_dir: Path | None = None, batch_invariant: bool = False) -> Model:
    """Build the model; converted (requantized / repacked) linears are cached under `cache_dir`.
    `batch_invariant`: each linear keeps one kernel whatever the row count (--deterministic)."""
    config, tensors = load_gguf(gguf_path)
    max_len = min(max_model_len or config.max_position, config.max_position)
    spec = QuantSpec.parse(quantization)
    cache = WeightCache(cache_dir, Path(gguf_path), spec, device) if cache_dir else None
    factory = LinearFactory(spec, dtype, device, cache.load() if cache else None, batch_invariant)
    model = ARCHITECTURES[config.arch](config, tensors, max_len, factory)
    factory.say_fallbacks()
    if cache and factory.built:
        cache.save(factory.built)
    made = factory.made
    del factory  # its loaded cache holds the tensors' first copies
    gather_weights(made)  # one huge-page block, in build order (CPU tensors only)
    return model
