"""A decode step as one compiled graph: embedding, every layer (KV write, attention over the sequence's
blocks), final norm and lm_head traced by torch.compile into one C++ program (inductor, `cpp_wrapper`).

Eager PyTorch spends most of a small model's batch-1 token on dispatching ~20 small ops per layer; one
graph removes that. Shapes are static but for the block table's length (one graph serves every context
length). The caches' block count is static too, so the step is saved per KV size (`--kv-memory`): marked
dynamic, each of the 2 x layers cache tensors became its own size input, converted by the compiled wrapper
on every call (~0.3 ms of a 10 ms SmolLM2 step). Positions, slots and the block table are tensor inputs: a
Python int would recompile every step.

A cold compile takes about a minute; loading the saved step a few seconds. `--compile auto` therefore
compiles at start only when this config's step was saved before; otherwise the run stays eager and, once
it exits, a detached process (`python -m tokenhaul.engine.compiled_decode CONFIG_JSON`) saves it for the
next start.
(A thread cannot do it: a process exiting while another thread runs OpenMP work aborts.)"""

from __future__ import annotations

import atexit
import dataclasses
import hashlib
import json
import os
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

from tokenhaul import native
from tokenhaul.config import EngineConfig
from tokenhaul.kv import decode_attention
from tokenhaul.kv.cache import KVCache
from tokenhaul.layers.attention import AttentionMetadata, AttnGroup
from tokenhaul.models.registry import Model


def _step(model: Model, kv: KVCache, ids: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor,
          table: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The traced step: one query per sequence; the causal (and sliding-window) mask is built in the graph.
    Returns the logits and each row's argmax (a greedy token, read while the logits are still in the cores'
    caches: numpy's argmax after the step took ~50 µs of a 4.4 ms SmolLM2 step)."""
    B, bs = ids.shape[0], kv.block_size
    keys = torch.arange(table.shape[1] * bs, device=ids.device)
    pos = positions.view(B, 1, 1, 1)
    mask = keys <= pos  # [B, 1, 1, L]: the sequence's own keys; block padding hidden
    window = model.config.sliding_window
    local = mask if window is None else mask & (keys > pos - window)
    meta = AttentionMetadata(positions, slots, [AttnGroup(B, 1, None, table, mask, local)], B, traced=True)
    logits = model.compute_logits(model.forward(ids, meta, kv))
    return logits, logits.argmax(-1)


# No size asserts: the wrapper checked every input's sizes and strides on each call (371 inputs, ~0.3 ms of a
# 5 ms SmolLM2 step, bench/RESULTS.md "The compiled step's per-call overhead"); `run` only ever passes the traced
# shapes (the key holds them) and the guard check is off for the same reason. The custom ops with a C function
# (native.c_shims) are called as such, not through the dispatcher.
OPTIONS = {"cpp_wrapper": True, "size_asserts": False}


class CompiledDecode:
    """Owns the compiled step per batch size; the runner sends it pure-decode steps once `ready`.

    Built with dynamo's `aot_compile` and saved beside inductor's cache: a restart loads it without tracing,
    and it runs without dynamo's per-call guard checks (~1.3 ms a SmolLM2 step: every weight's metadata)."""

    def __init__(self, model: Model, kv: KVCache, config: EngineConfig, cache_dir: Path,
                 batch_sizes: tuple[int, ...] = (1,)) -> None:
        self.model, self.kv, self.batch_sizes = model, kv, batch_sizes
        os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(cache_dir / "inductor"))
        key = self._key(config)
        self.paths = {B: Path(os.environ["TORCHINDUCTOR_CACHE_DIR"]) / f"tokenhaul-decode-{key}-b{B}.bin"
                      for B in batch_sizes}
        self._fns: dict[int, Callable] = {}
        self.ready = False
        self.compile_seconds = 0.0  # wall time of warm_up (cold: about a minute; saved: seconds)

    def _key(self, config: EngineConfig) -> str:
        """What the saved step depends on: the model and its storage, the KV layout, torch, and the code traced."""
        c = config
        root = Path(__file__).resolve().parents[1]
        code = b"".join(f.read_bytes() for d in ("models", "layers", "kv") for ext in ("*.py", "*.cpp")  # the kernels
                        for f in sorted((root / d).glob(ext)))  # too: the graph calls their C functions by signature
        parts_of = [self.model] + list(getattr(self.model, "layers", []))
        linears = [x for part in parts_of for x in vars(part).values() if hasattr(x, "tensors")]
        formats = [type(x).__name__ for part in parts_of for x in vars(part).values()]
        # the shapes traced as constants (sparse rows are split in parts per thread count) and sparse thresholds
        shapes = [tuple(tuple(t.shape) for t in lin.tensors()) for lin in linears]
        thresholds = [lin.threshold for lin in linears if hasattr(lin, "threshold")]
        parts = (c.model, c.dtype, c.quantization, c.kv_dtype, c.block_size, c.max_model_len, self.kv.num_blocks,
                 c.sparsity, torch.__version__, repr(self.model.config), formats, repr(shapes), thresholds,
                 hashlib.sha256(code + Path(__file__).read_bytes()).hexdigest())
        return hashlib.sha256(repr(parts).encode()).hexdigest()[:16]

    @property
    def cached(self) -> bool:
        """Whether this config's steps were compiled and saved before."""
        return all(p.exists() for p in self.paths.values())

    def accepts(self, batch: int) -> bool:
        return self.ready and batch in self._fns

    def warm_up(self) -> None:
        """Load or compile every batch size's step, against a scratch cache of the real one's shape (never
        touched but for block 0: `empty`, so its untouched pages are never made resident)."""
        t0 = time.perf_counter()
        kv = self.kv
        if kv.dtype in (torch.int8, torch.bfloat16) and not decode_attention.available():  # the graph calls it
            raise RuntimeError("the KV decode kernel did not build")
        scratch = KVCache.like(kv, torch.empty)
        for B, path in self.paths.items():
            dev = kv.device
            ids, positions, slots = (torch.zeros(B, dtype=torch.long, device=dev) for _ in range(3))  # not aliased
            table = torch.zeros(B, 2, dtype=torch.long, device=dev)
            torch._dynamo.mark_dynamic(table, 1)
            args = (self.model, scratch, ids, positions, slots, table)
            fn = None
            if path.exists():
                try:
                    with path.open("rb") as f:
                        fn = torch.compiler.load_compiled_function(f)
                except Exception:  # noqa: BLE001 - an unreadable or stale file: compile again
                    fn = None
            if fn is None:
                options = OPTIONS | {"aot_inductor.custom_ops_to_c_shims": native.c_shims()}
                step = torch.compile(_step, dynamic=False, fullgraph=True, options=options)
                with torch.inference_mode():  # inputs made outside, run inside, as the runner does
                    fn = step.aot_compile((args, {}))
                path.parent.mkdir(parents=True, exist_ok=True)
                fn.save_compiled_function(str(path))
            fn.disable_guard_check()
            with torch.inference_mode():
                fn(*args)  # runs once: a loaded file that cannot run fails here, not on a request
            self._fns[B] = fn
        self.compile_seconds = time.perf_counter() - t0
        self.ready = True

    def run(self, ids: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor,
            table: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """ids, positions, slots: [B]; table: [B, >= 2 blocks] (padding → block 0) → fp32 logits [B, vocab] and
        their argmax [B]."""
        return self._fns[ids.shape[0]](self.model, self.kv, ids, positions, slots, table)


def compile_after_exit(config: EngineConfig) -> None:
    """When this process exits, start a detached, low-priority process that compiles this config's decode step
    and saves it for the next start (at exit, so it never competes with the run that asked for it)."""
    cfg = json.dumps(dataclasses.asdict(config) | {"compile": "on", "itl_target_ms": 0.0, "draft_model": None},
                     sort_keys=True)
    if cfg not in _after_exit:
        _after_exit.add(cfg)
        atexit.register(subprocess.Popen, [sys.executable, "-m", "tokenhaul.engine.compiled_decode", cfg],
                        stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                        start_new_session=True, preexec_fn=lambda: os.nice(10))


_after_exit: set[str] = set()  # configs whose compile is already due at exit


if __name__ == "__main__":
    from tokenhaul.llm import LLM  # the engine's front door: loads the model as the parent did, compiles, exits

    LLM(**json.loads(sys.argv[1]))
