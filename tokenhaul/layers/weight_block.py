"""A model's weights moved into one block of memory backed by transparent huge pages, in the order they were
built (the order a step reads them). Tensors under 2 MB come from the C heap in 4 KB pages: a decode step
streaming ~100 MB of them walks ~25,000 pages, and each page walk stalls the stream (bench/RESULTS.md
"Weights in one huge-page block")."""

from __future__ import annotations

import ctypes
import mmap
from collections.abc import Iterable

import torch

HUGE_PAGE = 2 << 20
ALIGN = 64  # every storage starts on a cache line
_BLOCKS: set[int] = set()  # the address of every block's mapping: tensors already in one stay where they are


def huge_page_block(nbytes: int) -> torch.Tensor:
    """uint8 [nbytes], fresh anonymous memory starting on a 2 MB boundary, asked for huge pages where the kernel
    has them (Linux: MADV_HUGEPAGE, so the pages are huge when first written, whatever the THP setting short of
    never). Freed with the last tensor that views it."""
    region = mmap.mmap(-1, nbytes + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)  # shared: no THP
    if hasattr(mmap, "MADV_HUGEPAGE"):
        region.madvise(mmap.MADV_HUGEPAGE)
    whole = torch.frombuffer(region, dtype=torch.uint8)  # keeps `region` alive
    _BLOCKS.add(whole.data_ptr())
    start = -whole.data_ptr() % HUGE_PAGE
    return whole[start:start + nbytes]


def _tensor_fields(holder) -> list[tuple[str, torch.Tensor]]:
    """The holder's attributes that hold its weights (`tensors()`) or views of them: counters and other state a
    kernel writes stay where they are (the compiled step cannot take a written input viewed at another dtype)."""
    storages = {t.untyped_storage().data_ptr() for t in holder.tensors() if t.device.type == "cpu"} - _BLOCKS
    return [(name, v) for name, v in vars(holder).items()
            if isinstance(v, torch.Tensor) and v.untyped_storage().data_ptr() in storages]


def gather_weights(holders: Iterable[object]) -> int:
    """Move the CPU weights of `holders` (linears, embeddings: each one's `tensors()` and the attributes that
    view them) into one huge-page block, storage by storage in order: views stay views of one storage (a tied
    lm_head and its embedding stay one copy). Returns the bytes moved; the memory they leave is handed back to
    the system (glibc: malloc_trim)."""
    holders = list(holders)
    offsets: dict[int, int] = {}  # storage address → offset in the block
    total = 0
    for holder in holders:
        for _, t in _tensor_fields(holder):
            s = t.untyped_storage()
            if s.data_ptr() not in offsets:
                offsets[s.data_ptr()] = total
                total += -(-s.nbytes() // ALIGN) * ALIGN
    if total == 0:
        return 0
    block = huge_page_block(total)
    copied: set[int] = set()
    for holder in holders:
        for name, t in _tensor_fields(holder):
            s = t.untyped_storage()
            at = offsets[s.data_ptr()]
            if s.data_ptr() not in copied:
                block[at:at + s.nbytes()].copy_(torch.empty(0, dtype=torch.uint8).set_(s))
                copied.add(s.data_ptr())
            typed = block.view(t.dtype)  # storage offsets below count elements of the whole mapping
            setattr(holder, name, typed.as_strided(t.shape, t.stride(), typed.storage_offset() +
                                                   at // t.element_size() + t.storage_offset()))
    _trim_heap()
    return total


def _trim_heap() -> None:
    """Give the heap's free pages back (the weights' old copies); glibc only, a no-op elsewhere."""
    try:
        ctypes.CDLL(None).malloc_trim(0)
    except (OSError, AttributeError):
        pass
