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


def load_gguf(path: Path) -> tuple[ModelConfig, dict[str, GGUFWeight | torch.Tensor]]:
    """Read config and every tensor as stored (memory-mapped, nothing dequantized); names stay GGUF names."""
    reader = GGUFFile(path)
    names = {t.name for t in reader.tensors}
    config = config_from_metadata(read_metadata(reader), names)
    tensors: dict[str, GGUFWeight | torch.Tensor] = {}
    for t in reader.tensors:
        w = from_reader_tensor(t)
        heads = {"attn_q": config.num_heads, "attn_k": config.num_kv_heads}.get(t.name.split(".")[-2])
        if config.arch == "llama" and heads:
            perm = rope_permutation(w.shape[0], heads)
            w = w.permute_rows(perm) if isinstance(w, GGUFWeight) else w[torch.from_numpy(perm)]
        tensors[t.name] = w
    embed = tensors.get("token_embd.weight")
    if not config.vocab_size and embed is not None:  # no `{arch}.vocab_size` key, and the token list is not read
        config = dataclasses.replace(config, vocab_size=int(embed.shape[0]))
    return config, tensors
