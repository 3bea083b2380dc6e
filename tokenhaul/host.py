"""Facts about the host machine that several rooms key their measurements by."""

from __future__ import annotations

import ctypes
import os
import platform
import time
from pathlib import Path


def _cpuinfo(field: str) -> str | None:
    """The first value of `field` in /proc/cpuinfo; None where there is none."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(field):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return None


def cpu_model() -> str:
    """The CPU's model name (from /proc/cpuinfo where there is one)."""
    return _cpuinfo("model name") or platform.processor() or platform.machine()


def cpu_vendor() -> str:
    """The CPU's vendor id ("AuthenticAMD", "GenuineIntel"; "" where /proc/cpuinfo does not say)."""
    return _cpuinfo("vendor_id") or ""


def llc_bytes() -> int:
    """The last-level cache that CPU 0 sees, in bytes (sysfs; 0 where it does not say)."""
    best = (0, 0)
    for index in Path("/sys/devices/system/cpu/cpu0/cache").glob("index*"):
        try:
            level = int((index / "level").read_text())
            size = (index / "size").read_text().strip()
        except (OSError, ValueError):
            continue
        scale = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(size[-1:], 1)
        digits = size.rstrip("KMG")
        if digits.isdigit():
            best = max(best, (level, int(digits) * scale))
    return best[1]


def openmp_wait() -> str:
    """How OpenMP threads wait between ops in this process (chosen in tokenhaul/__init__.py unless the
    environment set it): a step's time depends on it as much as on any kernel."""
    spin = os.environ.get("GOMP_SPINCOUNT")
    return f"GOMP_SPINCOUNT={spin}" if spin else f"OMP_WAIT_POLICY={os.environ.get('OMP_WAIT_POLICY', 'unset')}"


def keep_freed_memory() -> bool:
    """Have glibc keep freed memory in the process; False where the C library is not glibc. By default glibc maps
    each block of 32 MB and more afresh and trims the heap's top past 128 KB, so a step's big tensors (logits, the
    lm_head's sums at many rows) return as new pages the kernel zeroes again: 14 % of a Qwen2.5-0.5B 32-stream
    decode step was the kernel's `clear_page` (perf). Kept: no mapped blocks, a 1 GiB trim threshold
    (bench/malloc_policy.py)."""
    if platform.libc_ver()[0] != "glibc":
        return False
    libc = ctypes.CDLL(None)
    m_trim_threshold, m_mmap_max = -1, -4  # malloc.h
    return bool(libc.mallopt(m_mmap_max, 0) & libc.mallopt(m_trim_threshold, 1 << 30))


def _cpu_times(cpus: set[int]) -> tuple[int, int] | None:
    """(busy, total) jiffies of `cpus` since boot, from /proc/stat; None where there is none."""
    try:
        lines = Path("/proc/stat").read_text().splitlines()
    except OSError:
        return None
    busy = total = 0
    for line in lines:
        name, *fields = line.split()
        if name.startswith("cpu") and name[3:].isdigit() and int(name[3:]) in cpus:
            values = [int(v) for v in fields[:8]]  # user nice system idle iowait irq softirq steal
            total += sum(values)
            busy += sum(values) - values[3] - values[4]
    return (busy, total) if total else None


def busy_cores(window: float = 0.1) -> float:
    """How many of this process's cores other work keeps busy now: /proc/stat sampled over `window` seconds
    (a 1-minute load average lags: it still reads ~1 a minute after a job ended); the load average where
    /proc/stat is missing."""
    cpus = os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else set(range(os.cpu_count() or 1))
    before = _cpu_times(cpus)
    if before is None:
        return os.getloadavg()[0] if hasattr(os, "getloadavg") else 0.0
    time.sleep(window)
    after = _cpu_times(cpus)
    total = after[1] - before[1] if after else 0
    return len(cpus) * (after[0] - before[0]) / total if total > 0 else 0.0
