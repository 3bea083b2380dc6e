"""Architecture registry: GGUF `general.architecture` → model class; `load_model` is the one entry."""

from __future__ import annotations

from typing import Protocol

import torch

from tokenhaul.kv.cache import KVCache
from tokenhaul.layers.attention import AttentionMetadata
from tokenhaul.models.config import ModelConfig
from tokenhaul.models.gemma3 import Gemma3Model
from tokenhaul.models.gguf import load_gguf
from tokenhaul.models.llama import LlamaModel


class Model(Protocol):
    config: ModelConfig

    def forward(self, input_ids: torch.Tensor, meta: AttentionMetadata, kv: KVCache) -> torch.Tensor: ...

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor: ...


ARCHITECTURES: dict[str, type] = {"llama": LlamaModel, "qwen2": LlamaModel, "gemma3": Gemma3Model}


def load_model(gguf_path, dtype: torch.dtype, device: str, max_model_len: int | None = None) -> Model:
    config, tensors = load_gguf(gguf_path, dtype, device)
    max_len = min(max_model_len or config.max_position, config.max_position)
    return ARCHITECTURES[config.arch](config, tensors, max_len)
