"""A model's architecture without its weights: a catalog alias or GGUF file (metadata only), or a
transformers `config.json` of a model that need not be installed (e.g. Llama-3-70B)."""

from __future__ import annotations

import json
import math
from pathlib import Path

from tokenhaul.errors import ModelError
from tokenhaul.models.config import SUPPORTED_ARCHS, ModelConfig

HF_ARCHS = {"llama": "llama", "mistral": "llama", "qwen2": "qwen2", "gemma3": "gemma3", "gemma3_text": "gemma3"}


def config_from_hf(cfg: dict) -> ModelConfig:
    """transformers config.json (dict) → ModelConfig; Gemma3 multimodal configs use their text_config."""
    cfg = cfg.get("text_config", cfg) | {"model_type": cfg.get("text_config", cfg).get("model_type")
                                         or cfg.get("model_type")}
    arch = HF_ARCHS.get(cfg.get("model_type") or "")
    if arch is None:
        raise ModelError(f"unsupported model_type '{cfg.get('model_type')}' in config.json "
                         f"(supported: {', '.join(sorted(HF_ARCHS))})")
    try:
        hidden, heads = int(cfg["hidden_size"]), int(cfg["num_attention_heads"])
        head_dim = int(cfg.get("head_dim") or hidden // heads)
        common = dict(
            arch=arch, hidden_size=hidden, num_layers=int(cfg["num_hidden_layers"]), num_heads=heads,
            num_kv_heads=int(cfg.get("num_key_value_heads") or heads), head_dim=head_dim,
            ffn_size=int(cfg["intermediate_size"]), vocab_size=int(cfg["vocab_size"]),
            max_position=int(cfg.get("max_position_embeddings", 8192)),
            norm_eps=float(cfg.get("rms_norm_eps", 1e-6)), rope_theta=float(cfg.get("rope_theta", 10_000.0)),
            tie_embeddings=bool(cfg.get("tie_word_embeddings", arch == "gemma3")),
            qkv_bias=bool(cfg.get("attention_bias", arch == "qwen2")))
    except (KeyError, TypeError, ValueError) as e:
        raise ModelError(f"config.json lacks or mangles a field: {e}") from None
    if arch == "gemma3":
        common.update(sliding_window=int(cfg.get("sliding_window", 512)),
                      sliding_pattern=int(cfg.get("sliding_window_pattern", 6)),
                      query_scale=float(cfg.get("query_pre_attn_scalar", head_dim)) ** -0.5,
                      embed_scale=math.sqrt(hidden), final_logit_softcap=cfg.get("final_logit_softcapping"))
    return ModelConfig(**common)


def load_model_config(spec: str) -> tuple[str, ModelConfig]:
    """(display name, config) for a catalog alias, a .gguf path, or a config.json path / its folder."""
    path = Path(spec)
    if path.is_dir() and (path / "config.json").is_file():
        path = path / "config.json"
    if path.suffix == ".json":
        try:
            cfg = json.loads(path.read_text())
        except (OSError, ValueError) as e:
            raise ModelError(f"cannot read {path}: {e}") from None
        return cfg.get("_name_or_path") or path.parent.name, config_from_hf(cfg)
    from tokenhaul.models import catalog
    from tokenhaul.models.gguf import config_from_gguf
    from tokenhaul.models.gguf_file import GGUFFile

    files = catalog.resolve(spec)
    return files.name, config_from_gguf(GGUFFile(files.gguf_path))  # memory-mapped: no tensor is read


__all__ = ["SUPPORTED_ARCHS", "config_from_hf", "load_model_config"]
