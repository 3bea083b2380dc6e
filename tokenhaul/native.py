"""The engine's small C++ ops (kv/decode_attention.cpp, layers/sparse_gemv.cpp, layers/int4_dequant.cpp): built
on first use with torch.utils.cpp_extension (~25 s on 2 cores, g++ and torch's headers), cached per machine in
TORCH_EXTENSIONS_DIR, registered as torch ops (so a compiled graph can call them). Without a compiler the
callers keep their pure-torch path; one stderr line says so.

torch guards a build with a `lock` file that a killed build leaves behind, and every later build then waits on
it forever; builds here hold an flock instead (the kernel drops it with its process) and clear such a file."""

from __future__ import annotations

import ctypes
import fcntl
import hashlib
import os
import sys
from collections.abc import Callable
from pathlib import Path

import torch

from tokenhaul import host

_loaded: dict[Path, bool] = {}
_c_shims: dict[str, str] = {}  # op name → the C declaration of its shim (see `c_shims`)


# Weight-row runs each thread streams at once in the int8 GEMVs (dense and gathered), by CPU vendor: more runs keep
# more lines in flight, which Intel's cores need and AMD's lose to (bench/RESULTS.md "Runs per thread by vendor":
# on Zen 4 the Qwen2.5-0.5B and SmolLM2 lm_heads read 1.13x with 2 runs than with 4; on Sapphire Rapids Qwen's
# layers read 1.14x with 4 than with 2).
STREAMS_BY_VENDOR = {"AuthenticAMD": 2}
STREAMS_DEFAULT = 4


def _flags() -> tuple[str, list[str]]:
    """-mavx2 -mfma where torch itself runs AVX2 kernels, and the int8 GEMVs' runs per thread for this vendor
    (the build is cached per machine and per flavour)."""
    streams = STREAMS_BY_VENDOR.get(host.cpu_vendor(), STREAMS_DEFAULT)
    tuning = [f"-DSTREAMS={streams}"]
    if torch.backends.cpu.get_cpu_capability() in ("AVX2", "AVX512"):
        return f"avx2-s{streams}", ["-O3", "-mavx2", "-mfma", *tuning]
    return f"generic-s{streams}", ["-O3", *tuning]


def _build_dir(name: str) -> Path:
    """One folder per op, Python and torch build (a .so built against another torch must not be loaded) and
    checkout: torch rebuilds when the sources' paths change, so two checkouts sharing one folder rebuilt in turn."""
    from torch.utils.cpp_extension import get_default_build_root

    root = Path(os.environ.get("TORCH_EXTENSIONS_DIR") or get_default_build_root())
    tag = f"py{sys.version_info.major}{sys.version_info.minor}-torch{torch.__version__}"
    checkout = hashlib.sha1(str(Path(__file__).resolve().parent).encode()).hexdigest()[:8]
    return root / f"tokenhaul-{tag}" / f"{name}-{checkout}"


def _build(name: str, source: Path, flags: list[str]) -> str:
    """Build and load under an flock on the build folder; a `lock` left by a killed torch build is removed.
    Returns the library's path."""
    from torch.utils.cpp_extension import load as build

    folder = _build_dir(name)
    folder.mkdir(parents=True, exist_ok=True)
    with open(folder.with_name(folder.name + ".flock"), "w") as guard:
        fcntl.flock(guard, fcntl.LOCK_EX)  # released when this process ends, however it ends
        (folder / "lock").unlink(missing_ok=True)  # only builds holding the flock create it: this one is stale
        return build(name, [str(source)], extra_cflags=flags, is_python_module=False, build_directory=str(folder),
                     verbose=bool(os.environ.get("TOKENHAUL_VERBOSE_BUILD")))


def load(source: Path, slower: str, fakes: dict[str, Callable] | None = None, parallel: bool = False,
         shims: dict[str, str] | None = None) -> bool:
    """Build and load `source` once per process, registering `fakes` (op name → shape function, for
    torch.compile) and `shims` (op name → declaration of the C function `source` exports for it); False (and
    `slower`, the fallback's cost, on stderr) if not. `parallel` compiles with -fopenmp: at::parallel_for is
    inline in torch's headers and runs serially in a build without it (the OpenMP calls resolve to torch's own
    libgomp, so its thread pool is shared)."""
    if source not in _loaded:
        flavour, flags = _flags()
        flags = flags + ["-fopenmp"] if parallel else flags
        try:
            path = _build(f"tokenhaul_{source.stem}_{flavour}", source, flags)
            for op, fn in (fakes or {}).items():
                torch.library.register_fake(op, fn)
            if shims:  # its symbols made global, so a compiled step's library resolves the shims against it
                ctypes.CDLL(path, mode=os.RTLD_NOW | os.RTLD_GLOBAL | os.RTLD_NOLOAD)
                _c_shims.update(shims)
            _loaded[source] = True
        except Exception as e:  # no compiler or headers: the pure-torch paths give the same answers
            print(f"tokenhaul: {source.name} not built ({type(e).__name__}: {str(e)[:200]}); {slower}",
                  file=sys.stderr)
            _loaded[source] = False
    return _loaded[source]


def c_shims() -> dict[torch._ops.OpOverload, list[str]]:
    """The loaded ops that export a C function for a compiled graph to call directly, not through the
    dispatcher's boxed call (~0.5 µs of conversions a call, 150 calls a SmolLM2 step): inductor's
    `aot_inductor.custom_ops_to_c_shims`, which names such a function aoti_torch_cpu_<op name>."""
    shims = {}
    for name, declaration in _c_shims.items():
        namespace, op = name.split("::")
        shims[getattr(getattr(torch.ops, namespace), op).default] = [declaration]
    return shims
