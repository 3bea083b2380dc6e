"""A decode step as one compiled program: embedding, every layer (KV write, attention over the sequence's
blocks), final norm and lm_head exported by torch.export and compiled ahead of time by AOTInductor into C++.

Eager PyTorch spends most of a small model's batch-1 token on dispatching ~20 small ops per layer; one
program removes that. Shapes are static but for the block table's length (one program serves every context
length); the caches' block count is static too, so the step is saved per KV size (`--kv-memory`). Positions,
slots and the block table are tensor inputs: a Python int would be traced as a constant.

The model's tensors are the program's constants, loaded by pointer (no copy, none in the saved package); a call
passes the step's four inputs and the KV cache's tensors. Compiled by torch.compile, the step took every weight
as an input: dynamo's walk over the model and one handle per tensor cost ~350 µs of a 4.6 ms SmolLM2 token.

A cold compile takes under a minute; loading the saved step about a second. `--compile auto` therefore
compiles at start only when this config's step was saved before; otherwise the run stays eager and, once
it exits, a detached process saves it for the next start (engine/detached_compile.py)."""

from __future__ import annotations

import functools
import hashlib
import os
import time
from collections.abc import Callable
from pathlib import Path

import torch

from tokenhaul import native
from tokenhaul.atomic import atomic_path
from tokenhaul.config import EngineConfig
from tokenhaul.engine import step_state
from tokenhaul.engine.step_state import Slot, bound, tensor_slots
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


OPTIONS = {"aot_inductor.package_constants_in_so": False}  # the weights stay where they are (loaded by pointer)
Step = Callable[[list[torch.Tensor]], list[torch.Tensor]]  # [ids, positions, slots, table, *cache] → [logits, top]


class _Traced(torch.nn.Module):
    """The step as torch.export takes it: the model's tensors as buffers `c<i>` (i: their place in
    `tensor_slots(model)`), which become the package's constants, and the KV cache's tensors as inputs after the
    step's own four. Each is bound into its place while traced. (A kernel's own counter, such as a sparse linear's
    `kept`, stays a constant: the kernel writes it through the pointer, outside what export sees.)"""

    def __init__(self, model: Model, kv: KVCache, consts: list[Slot], cache: list[Slot]) -> None:
        super().__init__()
        self.consts, self.cache = consts, cache
        self.step = functools.partial(_step, model, kv)  # not plain attributes: export looks for tensors in those
        for i, slot in enumerate(consts):
            self.register_buffer(f"c{i}", slot.get())

    def forward(self, ids: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor, table: torch.Tensor,
                *cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        consts = [getattr(self, f"c{i}") for i in range(len(self.consts))]
        with bound(self.consts, consts), bound(self.cache, cache):
            return self.step(ids, positions, slots, table)


class CompiledDecode:
    """Owns the compiled step per batch size; the runner sends it pure-decode steps once `ready`.

    Exported (torch.export, non-strict: plain Python runs, so the model's tensors can be bound to stand-ins) and
    compiled ahead of time by AOTInductor into a package saved beside inductor's cache: a restart loads it
    without tracing. The model's tensors are the package's constants, loaded by pointer once; a call hands over
    the step's four inputs and the KV cache's tensors only (engine/step_state.py)."""

    def __init__(self, model: Model, kv: KVCache, config: EngineConfig, cache_dir: Path,
                 batch_sizes: tuple[int, ...] = (1,)) -> None:
        self.model, self.kv, self.batch_sizes = model, kv, batch_sizes
        self.max_blocks = max(3, -(-config.max_model_len // kv.block_size))  # the block table's longest
        os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(cache_dir / "inductor"))
        key = self._key(config)
        self.paths = {B: Path(os.environ["TORCHINDUCTOR_CACHE_DIR"]) / f"tokenhaul-decode-{key}-b{B}.pt2"
                      for B in batch_sizes}
        self.slots = tensor_slots(model)
        self._cache = [s.get() for s in tensor_slots(kv)]  # a call's inputs after the step's four
        self._fns: dict[int, Step] = {}
        self.ready = False
        self.compile_seconds = 0.0  # wall time of warm_up (cold: about a minute; saved: seconds)

    def _key(self, config: EngineConfig) -> str:
        """What the saved step depends on: the model and its storage, the KV layout, torch, and the code traced."""
        c = config
        root = Path(__file__).resolve().parents[1]
        code = b"".join(f.read_bytes() for d in ("models", "layers", "kv") for ext in ("*.py", "*.cpp")  # the kernels
                        for f in sorted((root / d).glob(ext)))  # too: the graph calls their C functions by signature
        code += Path(__file__).read_bytes() + Path(step_state.__file__).read_bytes()
        parts_of = [self.model] + list(getattr(self.model, "layers", []))
        linears = [x for part in parts_of for x in vars(part).values() if hasattr(x, "tensors")]
        formats = [type(x).__name__ for part in parts_of for x in vars(part).values()]
        # the shapes traced as constants (sparse rows are split in parts per thread count) and sparse thresholds
        shapes = [tuple(tuple(t.shape) for t in lin.tensors()) for lin in linears]
        thresholds = [lin.threshold for lin in linears if hasattr(lin, "threshold")]
        parts = (c.model, c.dtype, c.quantization, c.kv_dtype, c.block_size, c.max_model_len, self.kv.num_blocks,
                 c.sparsity, torch.__version__, torch.backends.cpu.get_cpu_capability(), repr(self.model.config),
                 formats, repr(shapes), thresholds, hashlib.sha256(code).hexdigest())
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
            fn = None
            if path.exists():
                try:
                    fn = self._load(path)
                except Exception:  # noqa: BLE001 - an unreadable or stale file: compile again
                    fn = None
            if fn is None:
                self._compile((ids, positions, slots, table), scratch, path)
                fn = self._load(path)
            with torch.inference_mode():  # runs once: a loaded file that cannot run fails here, not on a request
                fn([ids, positions, slots, table, *(s.get() for s in tensor_slots(scratch))])
            self._fns[B] = fn
        self.compile_seconds = time.perf_counter() - t0
        self.ready = True

    def _compile(self, inputs: tuple[torch.Tensor, ...], scratch: KVCache, path: Path) -> None:
        """Export the step and compile it into a package at `path` (written whole: another process may load it)."""
        module = _Traced(self.model, scratch, self.slots, tensor_slots(scratch))
        cache = tuple(s.get() for s in module.cache)
        blocks = torch.export.Dim("blocks", min=2, max=self.max_blocks)
        with torch.inference_mode():
            ep = torch.export.export(module, (*inputs, *cache), strict=False,
                                     dynamic_shapes=(None, None, None, {1: blocks}, (None,) * len(cache)))
        if ep.constants:  # tensors the walk did not find: the package would load without them
            raise RuntimeError(f"the decode step reads tensors outside the model's parts: {list(ep.constants)}")
        if ep.graph_signature.buffers_to_mutate:
            raise RuntimeError(f"the decode step writes model tensors: {ep.graph_signature.buffers_to_mutate}")
        options = OPTIONS | {"aot_inductor.custom_ops_to_c_shims": native.c_shims()}
        path.parent.mkdir(parents=True, exist_ok=True)
        with atomic_path(path, suffix=".pt2") as tmp:  # the packager wants a name ending in .pt2
            torch._inductor.aoti_compile_and_package(ep, package_path=str(tmp), inductor_configs=options)

    def _load(self, path: Path) -> Step:
        """The package's step, the model's tensors loaded into it as constants, by pointer."""
        package = torch._inductor.aoti_load_package(str(path), run_single_threaded=True)
        names = package.get_constant_fqns()  # the model's tensors the step reads (not those only eager code does)
        slots = {f"c{i}": s for i, s in enumerate(self.slots)}
        if not set(names) <= slots.keys():
            raise RuntimeError(f"{path.name} was compiled for other model tensors")
        package.load_constants({n: slots[n].get() for n in names}, check_full_update=True, user_managed=True)
        return package.loader.boxed_run

    def run(self, ids: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor,
            table: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """ids, positions, slots: [B]; table: [B, >= 2 blocks] (padding → block 0) → fp32 logits [B, vocab] and
        their argmax [B]."""
        logits, top = self._fns[ids.shape[0]]([ids, positions, slots, table, *self._cache])
        return logits, top
