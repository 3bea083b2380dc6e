"""Measured linear-kernel times of this machine, per weight format, matrix shape and row count.

Operator profiling in the manner of Vidur (Agrawal et al., MLSys 2024): a CPU's kernels do not follow
the roofline — the packed int4 kernel costs like a loop of GEMVs, a bf16 GEMV has a fixed setup of tens
of microseconds, small matrices stream slower than large ones — so `this-machine` times the engine's own
linear for each shape a model uses, at a grid of row counts, and interpolates. A curve is measured on
first use (a few seconds per shape, over copies of random weights ≫ the last-level cache so every call
reads memory) and cached beside the calibration, per device: on CUDA the same curves time the engine's
GPU kernels (cuBLAS bf16, `_weight_int4pack_mm`, `_weight_int8pack_mm`) with CUDA events (whatif/clock.py)."""

from __future__ import annotations

import hashlib
import time
from functools import cache
from pathlib import Path

import torch

from tokenhaul.config import DTYPES
from tokenhaul.layers import linear
from tokenhaul.layers import quantization as _formats  # noqa: F401 - registers every packed format
from tokenhaul.models.config import ModelConfig
from tokenhaul.whatif import calibrate as cal
from tokenhaul.whatif import clock

ROWS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)
SPAN_BYTES = 64e6  # weights read per timed pass on a CPU: ≫ L3, as a step's many layers are
DENSE = ("bf16", "fp32")  # dense formats; the packed ones (int8, int4) as layers/linear registers them


@cache
def kernels_version() -> str:
    """A digest of the linears' code (layers/linear*.py, the C++ kernels): a curve timed before a kernel changed
    is not reused after."""
    folder = Path(linear.__file__).parent
    files = sorted(folder.glob("linear*.py")) + sorted(folder.glob("*.cpp")) + [folder / "int4_gemv.py"]
    return hashlib.sha256(b"".join(f.read_bytes() for f in files)).hexdigest()[:12]


def available_formats() -> tuple[str, ...]:
    return DENSE + tuple(f for f in ("int8", "int4") if f in linear.FORMATS)


def make_linear(fmt: str, weight: torch.Tensor, device: str = "cpu") -> linear.Linear:
    """The engine's linear for a weight format on `device`: dense bf16 / fp32, or a packed kernel (int8,
    int4) as registered in layers/linear.py, with bf16 activations as the engine runs them."""
    dense = fmt in DTYPES
    cls = linear.FORMATS["dense" if dense else fmt]
    group = 32 if fmt == "int4" else None
    return cls.build([weight], None, DTYPES[fmt] if dense else torch.bfloat16, torch.device(device), group)


def cache_bytes(level: int) -> float:
    """CPU cache size from sysfs (per core for L2, shared L3), 0 when unknown."""
    for idx in range(8):
        base = Path(f"/sys/devices/system/cpu/cpu0/cache/index{idx}")
        try:
            if int((base / "level").read_text()) == level and (base / "type").read_text().strip() != "Instruction":
                size = (base / "size").read_text().strip()
                mult = {"K": 2**10, "M": 2**20, "G": 2**30}.get(size[-1], 1)
                return float(size.rstrip("KMG")) * mult
        except (OSError, ValueError):
            continue
    return 0.0


def activations(fmt: str, rows: int, in_: int, device: str = "cpu", generator: torch.Generator | None = None
                ) -> torch.Tensor:
    """Inputs as the engine hands them to a `fmt` linear (fp32 for fp32 weights, else bf16), so a timed call
    has no input or output cast the engine's has not: an fp32 input cost a bf16 linear 0.3-2 ms at 512 rows."""
    dtype = DTYPES[fmt] if fmt in DTYPES else torch.bfloat16
    return torch.randn(rows, in_, generator=generator).to(device, dtype)


def call_each(lins: list[linear.Linear], x: torch.Tensor) -> None:
    """One timed pass: each linear once, its output dropped at once as in the engine's step. Keeping every
    output (a list) timed the allocator instead: 76 outputs of 512 x 3072 are 240 MB of fresh pages a pass."""
    for lin in lins:
        lin(x)


def span_bytes(device: str, working_set: float = 0.0) -> float:
    """Weights per timed pass. On a CPU: SPAN_BYTES, or the step's whole working set (a model's weights) where
    that is larger, up to twice the last-level cache (past it every read misses anyway) — a 95 MB model may
    stay in a 300 MB L3 where a 270 MB one spills, and its kernels are timed so. On a GPU: at least 4 × its L2."""
    if clock.is_cuda(device):
        return max(SPAN_BYTES, 4.0 * torch.cuda.get_device_properties(torch.device(device)).L2_cache_size)
    return float(round(min(max(working_set, SPAN_BYTES), max(SPAN_BYTES, 2.0 * cache_bytes(3))) / 1e6) * 1e6)


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


def measure_curve(fmt: str, out: int, in_: int, device: str = "cpu", span: float | None = None,
                  repeats: int = 3, rows: tuple[int, ...] = ROWS) -> list[tuple[int, float]]:
    """Best seconds per call of the engine's `fmt` linear of shape (out, in) on `device` at each row count
    of `rows` and on both sides of the format's kernel switch (`max_rows`), over copies of the weights
    spanning `span` bytes (default: span_bytes(device))."""
    g = torch.Generator().manual_seed(out * 7919 + in_)
    probe = make_linear(fmt, torch.randn(out, in_, generator=g), device)
    copies = max(4, int((span or span_bytes(device)) // max(probe.weight_bytes, 1)))
    lins = [probe] + [make_linear(fmt, torch.randn(out, in_, generator=g), device) for _ in range(copies - 1)]
    switch = getattr(probe, "max_rows", None)
    grid = sorted(set(rows) | ({switch, switch + 1} if switch else set()))
    curve = []
    for n in grid:
        x = activations(fmt, n, in_, device, g)
        best = clock.best_seconds(lambda x=x: call_each(lins, x), device, repeats, warmup=1)
        curve.append((n, best / len(lins)))
    return curve


class LinearTimes:
    """Seconds of one linear call per (format, shape, rows), from curves measured here and cached."""

    def __init__(self, formats: tuple[str, ...], root: Path | None = None, remeasure: bool = False,
                 device: str = "cpu") -> None:
        self.formats, self.root, self.remeasure, self.device = formats, root, remeasure, device
        self._curves: dict[str, list[tuple[int, float]]] = {}
        self._shapes: dict[str, tuple[str, int, int, float]] = {}  # key → (fmt, out, in, span) it was timed at

    def __call__(self, fmt: str, out: int, in_: int, rows: int, working_set: float = 0.0) -> float | None:
        """None where this machine has no kernel for `fmt`; `working_set`: the weight bytes a step reads (the
        span the curve is timed over, see span_bytes)."""
        if fmt not in self.formats or rows < 1:
            return None
        return interpolate(self.curve(fmt, out, in_, working_set), rows)

    def curve(self, fmt: str, out: int, in_: int, working_set: float = 0.0) -> list[tuple[int, float]]:
        span = span_bytes(self.device, working_set)
        key = self._key(fmt, out, in_, span)
        if key not in self._curves:
            entry = None if self.remeasure else cal.load_entry(key, self.root)
            if entry is None:
                entry = {"curve": measure_curve(fmt, out, in_, self.device, span=span), "measured_at": time.time()}
                cal.store_entry(key, entry, self.root)
            self._curves[key] = [(int(r), float(s)) for r, s in entry["curve"]]
            self._shapes[key] = (fmt, out, in_, span)
        return self._curves[key]

    def refresh(self) -> None:
        """Time every curve used so far again and keep, per row count, the fastest pass so far (stored): on a shared
        host a curve timed once can catch a slow spell at some row counts; the best of passes minutes apart does not."""
        for key, (fmt, out, in_, span) in self._shapes.items():
            again = dict(measure_curve(fmt, out, in_, self.device, span=span))
            best = [(r, min(s, again.get(r, s))) for r, s in self._curves[key]]
            self._curves[key] = best
            cal.store_entry(key, {"curve": best, "measured_at": time.time()}, self.root)

    def _key(self, fmt: str, out: int, in_: int, span: float) -> str:
        key = f"{cal.machine_key(self.device)} | linear | {fmt} | {out}x{in_} | kernels {kernels_version()}"
        if span != span_bytes(self.device):
            key += f" | span {span / 1e6:.0f} MB"
        return key

    def __eq__(self, other: object) -> bool:
        return isinstance(other, LinearTimes) and (self.formats, self.root, self.device) == (
            other.formats, other.root, other.device)

    __hash__ = None
