"""Measured linear-kernel times of this machine, per weight format, matrix shape and row count.

Operator profiling in the manner of Vidur (Agrawal et al., MLSys 2024): a CPU's kernels do not follow
the roofline — the packed int4 kernel costs like a loop of GEMVs, a bf16 GEMV has a fixed setup of tens
of microseconds, small matrices stream slower than large ones — so `this-machine` times the engine's own
linear for each shape a model uses, at a grid of row counts, and interpolates. A curve is measured on
first use (a few seconds per shape, over copies of random weights ≫ L3 so every call reads DRAM) and
cached beside the calibration."""

from __future__ import annotations

import time
from pathlib import Path

import torch

from tokenhaul.models.config import ModelConfig
from tokenhaul.whatif import calibrate as cal

ROWS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)
SPAN_BYTES = 64e6  # weights read per timed pass: ≫ L3, as a step's many layers are


def layer_shapes(cfg: ModelConfig) -> list[tuple[int, int]]:
    """(out, in) of one layer's linears as the engine fuses them: qkv, o, gate+up, down."""
    h, q, kv, f = cfg.hidden_size, cfg.q_size, cfg.kv_size, cfg.ffn_size
    return [(q + 2 * kv, h), (h, q), (2 * f, h), (h, f)]


def interpolate(curve: list[tuple[int, float]], rows: int) -> float:
    """Seconds at `rows`: linear between measured row counts, extended from the last two beyond them."""
    if rows <= curve[0][0]:
        return curve[0][1]
    for (r0, s0), (r1, s1) in zip(curve, curve[1:]):
        if rows <= r1:
            return s0 + (s1 - s0) * (rows - r0) / (r1 - r0)
    (r0, s0), (r1, s1) = curve[-2], curve[-1]
    return s1 + (s1 - s0) * (rows - r1) / (r1 - r0)


def measure_curve(fmt: str, out: int, in_: int, repeats: int = 3) -> list[tuple[int, float]]:
    """Best seconds per call of the engine's `fmt` linear of shape (out, in) at each row count of ROWS
    and on both sides of the format's kernel switch (`max_rows`)."""
    from tokenhaul.whatif.machine import make_linear

    g = torch.Generator().manual_seed(out * 7919 + in_)
    probe = make_linear(fmt, torch.randn(out, in_, generator=g))
    copies = max(4, int(SPAN_BYTES // max(probe.weight_bytes, 1)))
    lins = [probe] + [make_linear(fmt, torch.randn(out, in_, generator=g)) for _ in range(copies - 1)]
    switch = getattr(probe, "max_rows", None)
    grid = sorted(set(ROWS) | ({switch, switch + 1} if switch else set()))
    curve = []
    for rows in grid:
        x = torch.randn(rows, in_, generator=g)
        for lin in lins[:2]:
            lin(x)  # warm up
        best = float("inf")
        for _ in range(repeats):
            t = time.perf_counter()
            for lin in lins:
                lin(x)
            best = min(best, time.perf_counter() - t)
        curve.append((rows, best / len(lins)))
    return curve


class LinearTimes:
    """Seconds of one linear call per (format, shape, rows), from curves measured here and cached."""

    def __init__(self, formats: tuple[str, ...], root: Path | None = None, remeasure: bool = False) -> None:
        self.formats, self.root, self.remeasure = formats, root, remeasure
        self._curves: dict[str, list[tuple[int, float]]] = {}

    def __call__(self, fmt: str, out: int, in_: int, rows: int) -> float | None:
        """None where this machine has no kernel for `fmt`."""
        if fmt not in self.formats or rows < 1:
            return None
        return interpolate(self.curve(fmt, out, in_), rows)

    def curve(self, fmt: str, out: int, in_: int) -> list[tuple[int, float]]:
        key = f"{cal.machine_key()} | linear | {fmt} | {out}x{in_}"
        if key not in self._curves:
            entry = None if self.remeasure else cal.load_entry(key, self.root)
            if entry is None:
                entry = {"curve": measure_curve(fmt, out, in_), "measured_at": time.time()}
                cal.store_entry(key, entry, self.root)
            self._curves[key] = [(int(r), float(s)) for r, s in entry["curve"]]
        return self._curves[key]

    def __eq__(self, other: object) -> bool:
        return isinstance(other, LinearTimes) and (self.formats, self.root) == (other.formats, other.root)

    __hash__ = None
