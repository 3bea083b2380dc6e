"""Facts about the host machine that several rooms key their measurements by."""

from __future__ import annotations

import os
import platform
from pathlib import Path


def cpu_model() -> str:
    """The CPU's model name (from /proc/cpuinfo where there is one)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def openmp_wait() -> str:
    """How OpenMP threads wait between ops in this process (chosen in tokenhaul/__init__.py unless the
    environment set it): a step's time depends on it as much as on any kernel."""
    spin = os.environ.get("GOMP_SPINCOUNT")
    return f"GOMP_SPINCOUNT={spin}" if spin else f"OMP_WAIT_POLICY={os.environ.get('OMP_WAIT_POLICY', 'unset')}"
