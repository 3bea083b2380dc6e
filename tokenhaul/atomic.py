"""Atomic file replace: write a temporary file beside the target, then rename it over the target."""

from __future__ import annotations

import contextlib
import os
import threading
from collections.abc import Iterator
from pathlib import Path


@contextlib.contextmanager
def atomic_path(target: Path | str, suffix: str = "") -> Iterator[Path]:
    """Yield a temp path beside `target`, unique per process and thread (`suffix` ends its name); renamed
    over `target` when the block succeeds, removed when it raises, so readers see the old file or the whole new one."""
    target = Path(target)
    tmp = target.with_name(f"{target.name}.{os.getpid()}.{threading.get_ident()}.tmp{suffix}")
    try:
        yield tmp
        os.replace(tmp, target)
    except BaseException:
        with contextlib.suppress(OSError):
            tmp.unlink(missing_ok=True)
        raise
