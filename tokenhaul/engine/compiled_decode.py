"""A decode step as one compiled graph: embedding, every layer (KV write, attention over the sequence's
blocks), final norm and lm_head traced by torch.compile into one C++ program (inductor, `cpp_wrapper`).

Eager PyTorch spends most of a small model's batch-1 token on dispatching ~20 small ops per layer; one
graph removes that. Shapes are static but for two dimensions marked dynamic: the block table's length
(one graph serves every context length) and the caches' block count (the graph is compiled against a
two-block scratch cache, and its inductor artifacts serve any cache size). Positions, slots and the block
table are tensor inputs: a Python int would recompile every step.

A cold compile takes about a minute; from inductor's disk cache a few seconds. `--compile auto` therefore
compiles at start only when this config compiled before (a marker file beside inductor's cache); otherwise
the run stays eager and a detached process (`python -m tokenhaul.engine.compiled_decode CONFIG_JSON`)
fills the cache for the next start. (A thread cannot do it: a process exiting while another thread runs
OpenMP work aborts.)"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import torch

from tokenhaul.config import EngineConfig
from tokenhaul.kv.cache import KVCache
from tokenhaul.layers.attention import AttentionMetadata, AttnGroup
from tokenhaul.models.registry import Model


def _step(model: Model, kv: KVCache, ids: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor,
          table: torch.Tensor) -> torch.Tensor:
    """The traced step: one query per sequence; the causal (and sliding-window) mask is built in the graph."""
    B, bs = ids.shape[0], kv.block_size
    keys = torch.arange(table.shape[1] * bs, device=ids.device)
    pos = positions.view(B, 1, 1, 1)
    mask = keys <= pos  # [B, 1, 1, L]: the sequence's own keys; block padding hidden
    window = model.config.sliding_window
    local = mask if window is None else mask & (keys > pos - window)
    meta = AttentionMetadata(positions, slots, [AttnGroup(B, 1, None, table, mask, local)], B, traced=True)
    return model.compute_logits(model.forward(ids, meta, kv))


class CompiledDecode:
    """Owns the compiled step; the runner sends it pure-decode steps of `batch_sizes` rows once `ready`."""

    def __init__(self, model: Model, kv: KVCache, config: EngineConfig, cache_dir: Path,
                 batch_sizes: tuple[int, ...] = (1,)) -> None:
        self.model, self.kv, self.batch_sizes = model, kv, batch_sizes
        os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(cache_dir / "inductor"))  # a restart: seconds
        self.marker = Path(os.environ["TORCHINDUCTOR_CACHE_DIR"]) / f"tokenhaul-decode-{self._key(config)}.ok"
        for cache in (*kv.k, *kv.v):
            torch._dynamo.mark_dynamic(cache, 0)
        self._fn = torch.compile(_step, dynamic=False, fullgraph=True, options={"cpp_wrapper": True})
        self.ready = False
        self.compile_seconds = 0.0  # wall time of warm_up (cold: about a minute; from inductor's cache: seconds)

    def _key(self, config: EngineConfig) -> str:
        """What the compiled graph depends on: the model and its storage, the KV layout, torch itself."""
        c = config
        parts = (c.model, c.dtype, c.quantization, c.kv_dtype, c.block_size, c.max_model_len, self.batch_sizes,
                 torch.__version__, repr(self.model.config))
        return hashlib.sha256(repr(parts).encode()).hexdigest()[:16]

    @property
    def cached(self) -> bool:
        """Whether this config compiled before (its artifacts are then in inductor's cache)."""
        return self.marker.exists()

    def accepts(self, batch: int) -> bool:
        return self.ready and batch in self.batch_sizes

    def warm_up(self) -> None:
        """Compile every batch size against a two-block scratch cache (the real one is never touched)."""
        t0 = time.perf_counter()
        c, kv = self.model.config, self.kv
        scratch = KVCache(c.num_layers, 2, kv.block_size, c.num_kv_heads, c.head_dim, kv.dtype, kv.k[0].device)
        for cache in (*scratch.k, *scratch.v):
            torch._dynamo.mark_dynamic(cache, 0)
        dev = kv.k[0].device
        for B in self.batch_sizes:  # inputs made outside inference mode and run inside, as the runner does
            ids, positions, slots = (torch.zeros(B, dtype=torch.long, device=dev) for _ in range(3))  # not aliased
            table = torch.zeros(B, 2, dtype=torch.long, device=dev)
            with torch.inference_mode():
                self._call(scratch, ids, positions, slots, table)
        self.compile_seconds = time.perf_counter() - t0
        self.ready = True
        self.marker.parent.mkdir(parents=True, exist_ok=True)
        self.marker.write_text(f"{self.compile_seconds:.1f} s\n")

    def run(self, ids: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
        """ids, positions, slots: [B]; table: [B, >= 2 blocks] (padding → block 0) → fp32 logits [B, vocab]."""
        return self._call(self.kv, ids, positions, slots, table)

    def _call(self, kv: KVCache, *args: torch.Tensor) -> torch.Tensor:
        torch._dynamo.mark_dynamic(args[3], 1)
        return self._fn(self.model, kv, *args)


def compile_elsewhere(config: EngineConfig) -> subprocess.Popen:
    """Start a detached, low-priority process that compiles this config's decode step into inductor's cache."""
    cfg = dataclasses.asdict(config) | {"compile": "on", "num_kv_blocks": 4, "itl_target_ms": 0.0,
                                        "draft_model": None}
    return subprocess.Popen([sys.executable, "-m", "tokenhaul.engine.compiled_decode", json.dumps(cfg)],
                            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            start_new_session=True, preexec_fn=lambda: os.nice(10))


if __name__ == "__main__":
    from tokenhaul.llm import LLM  # the engine's front door: loads the model as the parent did, compiles, exits

    LLM(**json.loads(sys.argv[1]))
