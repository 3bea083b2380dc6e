"""The detached decode compile of `--compile auto` (engine/compiled_decode.py): a run that stayed eager starts,
at its exit, `python -m tokenhaul.engine.detached_compile CONFIG_JSON PACKAGE...`, which compiles and saves the
step for the next start. One per config across processes (a lock file beside the cache, held while it runs),
none once the packages are saved. (A thread cannot do it: a process exiting while another thread runs OpenMP work
aborts.)"""

from __future__ import annotations

import atexit
import dataclasses
import fcntl
import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

from tokenhaul.config import EngineConfig
from tokenhaul.models.catalog import cache_root


def detached_config(config: EngineConfig) -> str:
    """The detached compile's engine arguments for `config` (JSON): the same model and storage, compiled now."""
    return json.dumps(dataclasses.asdict(config) | {"compile": "on", "itl_target_ms": 0.0, "draft_model": None},
                      sort_keys=True)


def lock_path(cfg: str) -> Path:
    """The lock file a detached compile of `cfg` (detached_config's JSON) holds while it runs, beside the cache."""
    root = Path(os.environ.get("TORCHINDUCTOR_CACHE_DIR") or cache_root() / "inductor")
    return root / f"tokenhaul-decode-{hashlib.sha256(cfg.encode()).hexdigest()[:16]}.lock"


def _hold(path: Path) -> int | None:
    """Take the lock at `path`: its open descriptor (the lock lasts until it is closed or the process ends, however
    it ends: a dead compile's file blocks nothing), or None while another process holds it."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        os.close(fd)
        return None
    return fd


def compile_after_exit(config: EngineConfig, packages: tuple[Path, ...]) -> None:
    """When this process exits, start a detached, low-priority process that compiles this config's decode step
    into `packages` (CompiledDecode.paths) for the next start (at exit, so it never competes with the run that
    asked for it)."""
    cfg = detached_config(config)
    if cfg not in _after_exit:
        _after_exit.add(cfg)
        atexit.register(_spawn, cfg, packages)


def _spawn(cfg: str, packages: tuple[Path, ...]) -> None:
    """Start the detached compile of `cfg` unless its packages are saved by now or another process compiles it
    (the child takes the lock itself: of two started at once, one leaves at once)."""
    if packages and all(p.exists() for p in packages):
        return
    try:
        fd = _hold(lock_path(cfg))
    except OSError:  # no lock file can be made (a read-only cache): no compile, and no traceback at exit
        return
    if fd is None:
        return
    os.close(fd)
    subprocess.Popen([sys.executable, "-m", "tokenhaul.engine.detached_compile", cfg, *map(str, packages)],
                     stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                     start_new_session=True, preexec_fn=lambda: os.nice(10))


def main(argv: list[str]) -> None:
    """The detached compile: `CONFIG_JSON [PACKAGE...]`. Holds the config's lock while it runs (its pid in the
    file); leaves at once if another process holds it or the packages are saved, else loads the model as the
    parent did and compiles (the engine loads a step saved meanwhile instead)."""
    cfg, packages = argv[0], [Path(p) for p in argv[1:]]
    fd = _hold(lock_path(cfg))
    if fd is None:
        return
    try:
        os.ftruncate(fd, 0)
        os.write(fd, f"{os.getpid()}\n".encode())
        if packages and all(p.exists() for p in packages):
            return
        from tokenhaul.llm import LLM  # the engine's front door: compiles at start

        LLM(**json.loads(cfg))
    finally:
        os.close(fd)


_after_exit: set[str] = set()  # configs whose compile is already due at exit


if __name__ == "__main__":
    main(sys.argv[1:])
