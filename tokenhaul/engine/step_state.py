"""Every tensor a decode step reads, found where it lives (an attribute of a model part, an entry of a list such
as the KV cache's layers) and bound to stand-ins while the step is traced (engine/compiled_decode.py).

The compiled step takes the weights as constants loaded by pointer when it loads, not as inputs: handing a
SmolLM2 step its 371 tensors on every call cost ~350 µs of a 4.6 ms token (bench/RESULTS.md "Where a SmolLM2
token's time goes outside the compiled graph")."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Slot:
    """One place a tensor is held: `holder.<key>` (an object) or `holder[key]` (a list)."""

    holder: object
    key: str | int

    def get(self) -> torch.Tensor:
        return self.holder[self.key] if isinstance(self.key, int) else getattr(self.holder, self.key)

    def set(self, t: torch.Tensor) -> None:
        if isinstance(self.key, int):
            self.holder[self.key] = t
        else:
            setattr(self.holder, self.key, t)


def tensor_slots(root: object) -> list[Slot]:
    """The tensors reachable from `root` through the attributes of tokenhaul's own objects and through lists, in a
    fixed order (attribute order, depth first); an object reached twice (a norm shared as `next_norm`) counts once."""
    slots: list[Slot] = []
    seen: set[int] = set()

    def walk(obj: object) -> None:
        if id(obj) in seen:
            return
        seen.add(id(obj))
        items: Iterator[tuple[str | int, object]]
        if isinstance(obj, list):
            items = enumerate(obj)
        elif type(obj).__module__.startswith("tokenhaul.") and hasattr(obj, "__dict__"):
            items = iter(vars(obj).items())
        else:
            return
        for key, value in items:
            if isinstance(value, torch.Tensor):
                slots.append(Slot(obj, key))
            elif isinstance(value, tuple) and any(isinstance(v, torch.Tensor) for v in value):
                raise TypeError(f"{type(obj).__name__}.{key}: tensors in a tuple cannot be bound for tracing")
            else:
                walk(value)

    walk(root)
    return slots


@contextmanager
def bound(slots: Sequence[Slot], tensors: Sequence[torch.Tensor]) -> Iterator[None]:
    """Hold `tensors` in `slots` for the block's duration; the tensors held before are put back after."""
    before = [s.get() for s in slots]
    try:
        for s, t in zip(slots, tensors, strict=True):
            s.set(t)
        yield
    finally:
        for s, t in zip(slots, before):
            s.set(t)
