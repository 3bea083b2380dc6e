"""Key centers for int8 KV caches: per layer, the mean post-RoPE key of each KV head's channels over a text
sample, which int8 key caches subtract before quantizing (kv/int8.py). Cached per model in its cache dir.

Any center leaves attention exact; a good one shrinks what each token's int8 scale must span. The sample is the
calibration text activation sparsity uses (layers/sparse_calibration.py: the tail of each corpus part), read
through a scratch engine core whose KV cache holds float keys."""

from __future__ import annotations

import time
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from tokenhaul.atomic import atomic_path
from tokenhaul.layers.sparse_calibration import sample_ids
from tokenhaul.sampling_params import SamplingParams

VERSION = "1"


@torch.inference_mode()
def calibrate(llm) -> torch.Tensor:
    """[num_layers, Hkv, D] fp32: the mean key of each channel over the sample's positions, read from the scratch
    core's float KV cache after each window's prefill (llm: .model, .core, .tokenizer)."""
    model, core = llm.model, llm.core
    assert core.kv.dtype != torch.int8, "key centers are read from a float KV cache"
    total = torch.zeros(len(core.kv.k), core.kv.num_kv_heads, core.kv.head_dim, dtype=torch.float64)
    count = 0
    window = min(512, core.max_model_len - 1, core.config.max_num_batched_tokens)  # one prefill chunk
    for ids in sample_ids(llm.tokenizer, window):
        core.add_request("key-centers", ids, SamplingParams(max_tokens=1))
        try:
            sched = core.scheduler.schedule()
            inp = core.runner.prepare(sched)
            model.forward(inp.input_ids, inp.meta, core.kv)
            blocks = torch.tensor(sched.chunks[0].request.block_ids, device=core.kv.device)
            for i, k in enumerate(core.kv.k):
                total[i] += k[blocks].flatten(0, 1)[:len(ids)].double().sum(0).cpu()
            count += len(ids)
        finally:
            core.abort("key-centers")
    return (total / count).float()


def centers_path(cache_dir: Path) -> Path:
    return Path(cache_dir) / "kv-key-centers.safetensors"


def saved(cache_dir: Path) -> torch.Tensor | None:
    """The model's saved centers, or None (none saved, or saved by another version)."""
    path = centers_path(cache_dir)
    if not path.exists():
        return None
    with safe_open(str(path), "pt") as f:
        if (f.metadata() or {}).get("version") != VERSION:
            return None
    return load_file(str(path))["centers"]


def calibrate_and_save(llm) -> torch.Tensor:
    """`calibrate` through llm.core (a scratch core with a float KV cache), saved in the model's cache dir."""
    t0 = time.perf_counter()
    centers = calibrate(llm)
    path = centers_path(llm.files.cache_dir)
    path.parent.mkdir(parents=True, exist_ok=True)
    with atomic_path(path) as tmp:  # replicas starting together each write their own
        save_file({"centers": centers}, str(tmp), metadata={"version": VERSION, "model": llm.files.name,
                                                          "seconds": f"{time.perf_counter() - t0:.1f}"})
    return centers
