"""Roofline: where a step sits against this machine's measured read bandwidth and FLOP/s.

The limits come from `tokenhaul calibrate` (whatif/calibrate.py) or a hardware profile; bytes and FLOPs
from ledger/costs.py. A leaf module: it imports nothing from tokenhaul, so the ledger may read a roofline
it is handed without importing whatif."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Roofline:
    bandwidth: float  # bytes/s, measured read bandwidth (from DRAM)
    peak_flops: float  # FLOP/s, measured fp32 GEMM
    key: str = ""  # what was measured: CPU model | threads | device
    # read bandwidth over a buffer that stays in the last-level cache (half of it), and that buffer's size: a step
    # whose bytes fit there can read faster than DRAM (0: not measured)
    resident_bytes: float = 0.0
    resident_bandwidth: float = 0.0

    def for_working_set(self, nbytes: float) -> Roofline:
        """The roofline of steps that read `nbytes` each: the cache-resident bandwidth where they fit in the
        buffer measured in cache (a 95 MB model in a 480 MB L3 otherwise reads at "114 % of roofline"), else this."""
        if not (0 < nbytes <= self.resident_bytes) or self.resident_bandwidth <= self.bandwidth:
            return self
        return Roofline(self.resident_bandwidth, self.peak_flops, f"{self.key} | working set in the last-level cache")

    @property
    def ridge(self) -> float:
        """Arithmetic intensity (FLOP/byte) where compute, not data, becomes the limit."""
        return self.peak_flops / self.bandwidth

    def attainable(self, intensity: float) -> float:
        """FLOP/s reachable at `intensity` FLOP/byte."""
        return min(self.peak_flops, intensity * self.bandwidth)

    def data_seconds(self, nbytes: float) -> float:
        return nbytes / self.bandwidth

    def compute_seconds(self, flops: float) -> float:
        return flops / self.peak_flops

    def bound_seconds(self, nbytes: float, flops: float) -> float:
        """The least time the work can take on this machine."""
        return max(self.data_seconds(nbytes), self.compute_seconds(flops))

    def position(self, nbytes: float, flops: float, seconds: float) -> Position:
        intensity = flops / nbytes if nbytes else 0.0
        if seconds <= 0:
            return Position(intensity, 0.0, 0.0, 0.0, 0.0)
        return Position(intensity, nbytes / seconds / 1e9, flops / seconds / 1e9,
                        self.bound_seconds(nbytes, flops) / seconds, self.data_seconds(nbytes) / seconds)


@dataclass(frozen=True)
class Position:
    """One step (or one phase) on the roofline.

    roofline_fraction = achieved / attainable FLOP/s at this intensity, which equals the least time
    the work could take (max of data time and compute time) over the measured time. data_fraction =
    bytes ÷ bandwidth over measured time: the share of the time the data alone needs."""

    intensity: float  # FLOP/byte
    gb_per_s: float  # achieved
    gflop_per_s: float  # achieved
    roofline_fraction: float
    data_fraction: float

    def as_dict(self) -> dict[str, float]:
        return {"arithmetic_intensity": self.intensity, "achieved_gb_per_s": self.gb_per_s,
                "achieved_gflop_per_s": self.gflop_per_s, "roofline_fraction": self.roofline_fraction,
                "data_wait_fraction": self.data_fraction}
