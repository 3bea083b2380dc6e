"""The cyclic garbage collector kept off the objects that exist when a step loop starts.

With a model loaded the process holds ~385 k objects (torch, the model, its compiled step). The ledger's per-token
records age into the oldest generation, so every 1,000-2,000 SmolLM2 tokens Python ran a full collection over all
of them: one step stalled by 175-195 ms (bench/RESULTS.md "A full garbage collection in the token stream"). Inside
`frozen_heap` those objects are out of the collector's sight (`gc.freeze`); objects still die by reference count,
and on the last exit they are handed back (`gc.unfreeze`), so cycles among them are collected later, outside the
token stream."""

from __future__ import annotations

import contextlib
import gc
import threading
from collections.abc import Iterator

_lock = threading.Lock()
_depth = 0  # loops inside (nested generate calls, a server's core thread)


@contextlib.contextmanager
def frozen_heap() -> Iterator[None]:
    """Freeze the heap on the first entry, hand it back on the last exit."""
    global _depth
    with _lock:
        if _depth == 0:
            gc.freeze()
        _depth += 1
    try:
        yield
    finally:
        with _lock:
            _depth -= 1
            if _depth == 0:
                gc.unfreeze()
