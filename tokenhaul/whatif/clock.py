"""Timing a call on the device that runs its kernels: the wall clock on the CPU, CUDA events on a GPU.

CUDA kernels run asynchronously, so a wall clock around a call measures its launches. There a call is
timed between two events recorded on the device's current stream (`torch.cuda.Event`, enable_timing),
read once the end event has completed. Every measurement of `this-machine` goes through here, so the
CPU path (tested) and the CUDA path differ only in `seconds`."""

from __future__ import annotations

import time
from collections.abc import Callable

import torch

from tokenhaul.errors import TokenhaulError

DEVICES = ("cpu", "cuda")  # the device types a machine profile can be measured for


def check_device(device: str) -> None:
    """Raise TokenhaulError (one line) unless `device` can be measured here: the CPU, or CUDA with a GPU."""
    try:
        kind = torch.device(device).type
    except RuntimeError:
        raise TokenhaulError(f"unknown device '{device}' (choose from {', '.join(DEVICES)})") from None
    if kind not in DEVICES:
        raise TokenhaulError(f"this-machine profiles are measured on {' or '.join(DEVICES)}, not '{device}'")
    if kind == "cuda" and not torch.cuda.is_available():
        raise TokenhaulError(f"'{device}' asked for, but this machine has no CUDA GPU (torch.cuda.is_available() "
                             f"is False; torch {torch.__version__})")


def is_cuda(device: str) -> bool:
    return torch.device(device).type == "cuda"


def synchronize(device: str) -> None:
    """Wait for the device's queued kernels (nothing to wait for on the CPU)."""
    if is_cuda(device):
        torch.cuda.synchronize(device)


def seconds(fn: Callable[[], object], device: str) -> float:
    """Seconds one call of `fn` keeps `device` busy, from its first kernel to the end of its last."""
    if is_cuda(device):
        stream = torch.cuda.current_stream(torch.device(device))
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record(stream)
        fn()
        end.record(stream)
        end.synchronize()
        return start.elapsed_time(end) / 1e3  # milliseconds
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def best_seconds(fn: Callable[[], object], device: str, repeats: int = 3, warmup: int = 1) -> float:
    """Best of `repeats` timed calls after `warmup` untimed ones: on a shared machine the least-disturbed
    run is the reproducible one."""
    for _ in range(warmup):
        fn()
    synchronize(device)
    return min(seconds(fn, device) for _ in range(max(1, repeats)))
