"""GGUF → ModelConfig + named weight tensors (dequantized to the compute dtype)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
from gguf import GGUFReader, GGUFValueType
from gguf.quants import dequantize

from tokenhaul.errors import ModelError
from tokenhaul.models.config import ModelConfig, config_from_metadata

_SKIP_FIELDS = ("tokenizer.ggml.tokens", "tokenizer.ggml.scores", "tokenizer.ggml.token_type",
                "tokenizer.ggml.merges")


def open_gguf(path: Path) -> GGUFReader:
    try:
        return GGUFReader(str(path))
    except Exception as e:  # gguf raises ValueError/struct errors on foreign files
        raise ModelError(f"{path} is not a readable GGUF file: {e}") from None


def read_metadata(reader: GGUFReader) -> dict:
    """Scalar and string metadata (large tokenizer arrays skipped)."""
    meta: dict = {}
    for key, field in reader.fields.items():
        if key in _SKIP_FIELDS:
            continue
        if field.types and field.types[0] == GGUFValueType.ARRAY and len(field.data) > 1024:
            continue
        try:
            meta[key] = field.contents()
        except Exception:  # noqa: BLE001 - exotic field types are not needed
            continue
    return meta


def _unpermute_rope(w: np.ndarray, n_head: int) -> np.ndarray:
    """Undo llama.cpp's Q/K row permutation for Llama so one (NeoX, half-split) RoPE serves every model."""
    rows = w.shape[0]
    return w.reshape(n_head, rows // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def load_gguf(path: Path, dtype: torch.dtype = torch.float32,
              device: str | torch.device = "cpu") -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    """Read config and every tensor, dequantized to `dtype` on `device`; names stay GGUF names."""
    reader = open_gguf(path)
    names = {t.name for t in reader.tensors}
    config = config_from_metadata(read_metadata(reader), names)
    tensors: dict[str, torch.Tensor] = {}
    for t in reader.tensors:
        arr = dequantize(t.data, t.tensor_type)
        if config.arch == "llama" and t.name.endswith(("attn_q.weight", "attn_q.bias")):
            arr = _unpermute_rope(arr, config.num_heads)
        elif config.arch == "llama" and t.name.endswith(("attn_k.weight", "attn_k.bias")):
            arr = _unpermute_rope(arr, config.num_kv_heads)
        tdtype = torch.float32 if arr.ndim == 1 else dtype  # norms and biases stay fp32
        tensors[t.name] = torch.from_numpy(np.array(arr, dtype=np.float32)).to(device, tdtype)
    return config, tensors
