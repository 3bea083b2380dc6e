"""The OpenMP wait choice at import reads how busy the cores are now (host.busy_cores), not a lagging average; the
C library keeps freed memory unless told not to (host.keep_freed_memory)."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from contextlib import contextmanager

from tokenhaul.host import busy_cores

CORES = len(os.sched_getaffinity(0))
WAIT_VARS = ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")


@contextmanager
def spinning(n: int):
    """`n` processes that keep a core busy each while the block runs."""
    procs = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(n)]
    try:
        time.sleep(0.3)  # scheduled and running
        yield
    finally:
        for p in procs:
            p.kill()
            p.wait()


def _choice(env: dict[str, str]) -> tuple[str | None, str | None]:
    code = "import os, tokenhaul; print(os.environ.get('OMP_WAIT_POLICY'), os.environ.get('GOMP_SPINCOUNT'))"
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True).stdout
    return tuple(None if v == "None" else v for v in out.split())


def test_busy_cores_sees_every_core_spinning():
    with spinning(CORES):
        assert busy_cores() >= 0.75 * CORES


def test_import_sleeps_at_once_when_other_work_holds_the_cores():
    env = {k: v for k, v in os.environ.items() if k not in WAIT_VARS}
    with spinning(CORES):
        assert _choice(env) == ("PASSIVE", None)


def test_environment_wins_over_the_choice():
    env = {k: v for k, v in os.environ.items() if k not in WAIT_VARS} | {"GOMP_SPINCOUNT": "123"}
    with spinning(CORES):
        assert _choice(env) == (None, "123")


def _resident_after_free(env: dict[str, str]) -> tuple[float, float]:
    """(MB resident with a touched 256 MB tensor, MB after freeing it) in a fresh process importing tokenhaul."""
    code = """
import tokenhaul, torch
def rss():
    return next(int(x.split()[1]) for x in open("/proc/self/status") if x.startswith("VmRSS:")) / 1024
t = torch.ones(64 << 20)
held = rss()
del t
print(held, rss())
"""
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True).stdout
    held, after = (float(v) for v in out.split())
    return held, after


def test_freed_memory_stays_unless_opted_out():
    """Kept (the default on glibc): a freed 256 MB block stays resident, ready for the next step's tensors without
    the kernel zeroing new pages; TOKENHAUL_KEEP_FREED_MEMORY=0 leaves glibc's default, which hands it back."""
    from tokenhaul.host import keep_freed_memory

    base = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_") and k != "TOKENHAUL_KEEP_FREED_MEMORY"}
    assert keep_freed_memory()  # glibc here
    held, after = _resident_after_free(base)
    assert after > held - 32
    held, after = _resident_after_free(base | {"TOKENHAUL_KEEP_FREED_MEMORY": "0"})
    assert after < held - 200
