"""The engine's small C++ ops (kv/int8_attention.cpp, layers/sparse_gemv.cpp, layers/int4_dequant.cpp): built
on first use with torch.utils.cpp_extension (~25 s on 2 cores, g++ and torch's headers), cached per machine in
TORCH_EXTENSIONS_DIR, registered as torch ops (so a compiled graph can call them). Without a compiler the
callers keep their pure-torch path; one stderr line says so."""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from pathlib import Path

import torch

_loaded: dict[Path, bool] = {}


def _flags() -> tuple[str, list[str]]:
    """-mavx2 -mfma where torch itself runs AVX2 kernels (the build is cached per machine and per flavour)."""
    if torch.backends.cpu.get_cpu_capability() in ("AVX2", "AVX512"):
        return "avx2", ["-O3", "-mavx2", "-mfma"]
    return "generic", ["-O3"]


def load(source: Path, slower: str, fakes: dict[str, Callable] | None = None, parallel: bool = False) -> bool:
    """Build and load `source` once per process, registering `fakes` (op name → shape function, for
    torch.compile); False (and `slower`, the fallback's cost, on stderr) if not. `parallel` compiles with
    -fopenmp: at::parallel_for is inline in torch's headers and runs serially in a build without it (the
    OpenMP calls resolve to torch's own libgomp, so its thread pool is shared)."""
    if source not in _loaded:
        from torch.utils.cpp_extension import load as build

        flavour, flags = _flags()
        flags = flags + ["-fopenmp"] if parallel else flags
        try:
            build(f"tokenhaul_{source.stem}_{flavour}", [str(source)], extra_cflags=flags, is_python_module=False,
                  verbose=bool(os.environ.get("TOKENHAUL_VERBOSE_BUILD")))
            for op, fn in (fakes or {}).items():
                torch.library.register_fake(op, fn)
            _loaded[source] = True
        except Exception as e:  # no compiler or headers: the pure-torch paths give the same answers
            print(f"tokenhaul: {source.name} not built ({type(e).__name__}: {str(e)[:200]}); {slower}",
                  file=sys.stderr)
            _loaded[source] = False
    return _loaded[source]
