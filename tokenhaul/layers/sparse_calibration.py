"""Calibrate activation-sparsity thresholds: per layer and per projection input, the magnitude under which
a target share of the inputs falls on a text sample (TEAL). Cached per model in its cache dir.

The sample is the tail of each part of the shipped corpus (tokenhaul/eval/corpus; `eval ppl` scores the
head, so calibration and evaluation text do not overlap unless the whole corpus is scored)."""

from __future__ import annotations

import json
import time
from pathlib import Path

import torch

from tokenhaul.atomic import atomic_path
from tokenhaul.eval.perplexity import CORPUS_DIR, PARTS
from tokenhaul.layers.linear_sparse import SPARSE_LINEARS
from tokenhaul.sampling_params import SamplingParams

LEVELS = (0.25, 0.4, 0.5)  # computed together from one pass; others are added on demand
WINDOW = 512
TOKENS_PER_PART = 1024
SAMPLES_PER_CALL = 32768  # |x| values kept per projection call (uniform, seeded) for the quantiles
VERSION = 2  # 2: the lm_head input too


class _Recorder:
    """Stands in for a projection during calibration: keeps a sample of |input|, then calls it."""

    def __init__(self, inner, gen: torch.Generator) -> None:
        self.inner, self.gen, self.samples = inner, gen, []

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        a = x.detach().abs().float().flatten()
        if a.numel() > SAMPLES_PER_CALL:
            a = a[torch.randint(a.numel(), (SAMPLES_PER_CALL,), generator=self.gen)]
        self.samples.append(a.cpu())
        return self.inner(x) if self.inner is not None else x


def sample_ids(tokenizer, window: int = WINDOW) -> list[list[int]]:
    """Windows of the calibration text: the last TOKENS_PER_PART tokens of each corpus part."""
    out = []
    for p in PARTS:
        ids = tokenizer.encode((CORPUS_DIR / f"{p}.txt").read_text(encoding="utf-8"))[-TOKENS_PER_PART:]
        out += [ids[i:i + window] for i in range(0, len(ids), window) if len(ids[i:i + window]) > 1]
    return out


@torch.inference_mode()
def calibrate(llm, levels: tuple[float, ...] = LEVELS) -> dict[str, dict[str, float]]:
    """{level: {"blk.{i}.{proj}" or "lm_head": threshold}} from the model as loaded (dense, before sparsify)."""
    model, core = llm.model, llm.core
    gen = torch.Generator().manual_seed(0)
    recorders: dict[str, _Recorder] = {}
    for i, layer in enumerate(model.layers):
        for name in SPARSE_LINEARS:
            recorders[f"blk.{i}.{name}"] = rec = _Recorder(getattr(layer, name), gen)
            setattr(layer, name, rec)
    recorders["lm_head"] = head = _Recorder(None, gen)  # samples only: no logits needed
    try:
        window = min(WINDOW, core.max_model_len - 1, core.config.max_num_batched_tokens)  # one prefill chunk
        for ids in sample_ids(llm.tokenizer, window):
            core.add_request("calibrate", ids, SamplingParams(max_tokens=1))
            try:
                inp = core.runner.prepare(core.scheduler.schedule())
                head(model.forward(inp.input_ids, inp.meta, core.kv))  # the lm_head's input, every position
            finally:
                core.abort("calibrate")
    finally:
        for key, rec in recorders.items():
            if key == "lm_head":
                continue
            i, name = key.split(".")[1:]
            setattr(model.layers[int(i)], name, rec.inner)
    q = torch.tensor(levels, dtype=torch.float32)
    out: dict[str, dict[str, float]] = {str(lv): {} for lv in levels}
    for key, rec in recorders.items():
        th = torch.quantile(torch.cat(rec.samples), q)
        for lv, t in zip(levels, th.tolist()):
            out[str(lv)][key] = t
    return out


def calibration_path(cache_dir: Path) -> Path:
    return Path(cache_dir) / "sparsity-thresholds.json"


def _saved(cache_dir: Path) -> dict:
    path = calibration_path(cache_dir)
    data = json.loads(path.read_text()) if path.exists() else {}
    return data if data.get("version") == VERSION else {}


def is_calibrated(cache_dir: Path, sparsity: float) -> bool:
    """Whether the model's cache dir holds thresholds for `sparsity` (load_or_calibrate will not run the model)."""
    return str(float(sparsity)) in _saved(cache_dir).get("levels", {})


def load_or_calibrate(llm, sparsity: float, force: bool = False) -> dict[str, float]:
    """Thresholds for `sparsity`, from the model's cache dir, or calibrated now (and saved)."""
    path = calibration_path(llm.files.cache_dir)
    data = {} if force else _saved(llm.files.cache_dir)
    key = str(float(sparsity))
    if key not in data.get("levels", {}):
        t0 = time.perf_counter()
        levels = tuple(sorted({*LEVELS, float(sparsity)}))
        data = {"version": VERSION, "model": llm.files.name, "levels": calibrate(llm, levels),
                "sample": f"last {TOKENS_PER_PART} tokens of each of {', '.join(PARTS)} (tokenhaul/eval/corpus)",
                "seconds": round(time.perf_counter() - t0, 1)}
        path.parent.mkdir(parents=True, exist_ok=True)
        with atomic_path(path) as tmp:
            tmp.write_text(json.dumps(data, indent=1))
    return data["levels"][key]
