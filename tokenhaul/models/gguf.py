"""GGUF → ModelConfig + named weights: 2-D weights stay as the file's quantized blocks (GGUFWeight), 1-D
ones (norms, biases) become fp32 tensors. layers/quantization.py decides what each weight becomes."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
import torch

from tokenhaul.layers.gguf_weight import GGUFWeight, from_reader_tensor
from tokenhaul.models.config import ModelConfig, config_from_metadata
from tokenhaul.models.gguf_file import GGUFFile

_SKIP_FIELDS = ("tokenizer.ggml.tokens", "tokenizer.ggml.scores", "tokenizer.ggml.token_type",
                "tokenizer.ggml.merges")


def read_metadata(reader: GGUFFile) -> dict:
    """Scalar, string and short-array metadata (tokenizer arrays skipped)."""
    return {k: v for k, v in reader.metadata.items() if k not in _SKIP_FIELDS}


def rope_permutation(rows: int, n_head: int) -> np.ndarray:
    """Row order undoing llama.cpp's Q/K permutation for Llama, so one (NeoX, half-split) RoPE serves all."""
    return np.arange(rows).reshape(n_head, rows // n_head // 2, 2).swapaxes(1, 2).reshape(-1)


def config_from_gguf(reader: GGUFFile) -> ModelConfig:
    """The model's config from a GGUF's metadata and tensor list; no tensor data is read. A file without
    `{arch}.vocab_size` (Qwen2.5, Gemma3; the token list is not read) takes the embedding's rows."""
    config = config_from_metadata(read_metadata(reader), {t.name for t in reader.tensors})
    embed = next((t for t in reader.tensors if t.name == "token_embd.weight"), None)
    if not config.vocab_size and embed is not None:
        config = dataclasses.replace(config, vocab_size=int(embed.shape[-1]))  # GGUF dims: innermost first
    return config


def load_gguf(path: Path) -> tuple[ModelConfig, dict[str, GGUFWeight | torch.Tensor]]:
    """Read config and every tensor as stored (memory-mapped, nothing dequantized); names stay GGUF names."""
    reader = GGUFFile(path)
    config = config_from_gguf(reader)
    tensors: dict[str, GGUFWeight | torch.Tensor] = {}
    for t in reader.tensors:
        w = from_reader_tensor(t)
        heads = {"attn_q": config.num_heads, "attn_k": config.num_kv_heads}.get(t.name.split(".")[-2])
        if config.arch == "llama" and heads:
            perm = rope_permutation(w.shape[0], heads)
            w = w.permute_rows(perm) if isinstance(w, GGUFWeight) else w[torch.from_numpy(perm)]
        tensors[t.name] = w
    return config, tensors
