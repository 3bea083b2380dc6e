"""Hardware profiles: memory tiers, compute per operand format, chips, links, overheads, energy.

Profiles are TOML data files under `whatif/hardware/` (every value cites its public source in a
comment); `this-machine` (the CPU) and `this-machine-cuda` (a CUDA GPU here) are built from calibration
(whatif/machine.py) instead of a file."""

from __future__ import annotations

import tomllib
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from tokenhaul.errors import TokenhaulError

HARDWARE_DIR = Path(__file__).parent / "hardware"
THIS_MACHINE = "this-machine"  # the CPU the engine runs on, calibrated here
THIS_MACHINE_CUDA = "this-machine-cuda"  # this machine's CUDA GPU, calibrated here (where there is one)


@dataclass(frozen=True)
class Tier:
    """One memory tier of one chip. `holds`: weights / KV may be placed here (False: a cache they
    stream through, e.g. a GPU's L2); tiers are listed fastest first."""

    name: str
    capacity: float  # bytes per chip
    bandwidth: float  # bytes/s per chip
    pj_per_byte: float | None = None
    holds: bool = True


@dataclass(frozen=True)
class PIM:
    """Processing in memory: the listed ops run inside the memory at its internal bandwidth, so their
    bytes never cross the memory bus (AttAcc / NeuPIMs style)."""

    ops: tuple[str, ...]  # "attention" (decode attention), "gemv" (linears of small-batch decode steps)
    internal_bandwidth: float  # bytes/s per chip, summed over banks
    flops: float  # FLOP/s per chip of the in-memory units
    gemv_max_rows: int = 4  # linears of steps with at most this many tokens run in memory
    pj_per_byte: float | None = None


@dataclass(frozen=True)
class Hardware:
    name: str
    description: str
    tiers: tuple[Tier, ...]
    flops: dict[str, float]  # FLOP/s per chip by operand format (both operands): fp32, bf16, fp8, int8, attention
    chips: int = 1  # chips per model replica; 0 = as many as the weights and KV need
    tensor_parallel: int = 8  # chips sharing each layer (all-reduces); more chips form pipeline stages
    link_bandwidth: float = 0.0  # bytes/s per chip, one direction, chip to chip
    link_latency: float = 0.0  # seconds per collective step
    step_overhead: float = 0.0  # seconds per step (scheduling, launch, host work)
    layer_overhead: float = 0.0  # seconds per layer per step (kernel launches / op dispatch)
    group_overhead: float = 0.0  # seconds per decode attention call past the first, per layer per step
    prefill_layer_overhead: float = 0.0  # more seconds per layer of a step with prompt chunks
    prefill_call_overhead: float = 0.0  # more seconds per call of many queries (causal mask), per layer
    gather_overhead: float = 0.0  # more seconds per call that gathers K/V of several sequences, per layer
    token_overhead: float = 0.0  # seconds per token per step (host-side batch building)
    kernel_bandwidth: dict[str, float] = field(default_factory=dict)  # share of tier bandwidth per format
    weight_only_flops: dict[str, float] = field(default_factory=dict)  # measured kernels for int8/int4 weights
    activation_bandwidth: float = 0.0  # bytes/s of elementwise traffic (0: the fastest tier's)
    gather_bandwidth: float = 0.0  # bytes/s of tokenhaul's gathered K/V copy (paged_kernel = "gather")
    paged_kernel: str = "fused"  # "fused": attention reads paged KV in place; "gather": tokenhaul's copy
    pj_per_flop: float | None = None
    pim: PIM | None = None
    source: str = ""
    # measured seconds of one linear call (format, out, in, rows, weight bytes a step reads) → s, None without
    # a kernel (this-machine)
    linear_times: Callable[[str, int, int, int, float], float | None] | None = field(default=None, compare=False)

    def linear_flops(self, fmt: str) -> float:
        """FLOP/s of a linear whose weights are stored as `fmt`. The engine's int8 / int4 are weight-only:
        they multiply in bf16 unless the profile measured a kernel for them (this-machine does)."""
        if fmt in self.weight_only_flops:
            return self.weight_only_flops[fmt]
        return self.flops_for("bf16" if fmt in ("int8", "int4") else fmt)

    def flops_for(self, fmt: str) -> float:
        """FLOP/s for an operand format, else bf16's, else fp32's."""
        for f in (fmt, "bf16", "fp32"):
            if self.flops.get(f):
                return self.flops[f]
        raise TokenhaulError(f"hardware '{self.name}' lists no FLOP/s")

    @property
    def holding_tiers(self) -> tuple[Tier, ...]:
        return tuple(t for t in self.tiers if t.holds)

    @property
    def capacity(self) -> float:
        """Bytes per chip that can hold weights and KV."""
        return sum(t.capacity for t in self.holding_tiers)


def profile_names() -> list[str]:
    return [THIS_MACHINE, THIS_MACHINE_CUDA] + sorted(p.stem for p in HARDWARE_DIR.glob("*.toml"))


def from_dict(d: dict, name: str, source: str = "") -> Hardware:
    try:
        tiers = tuple(Tier(**t) for t in d["tier"])
        pim = PIM(**(d["pim"] | {"ops": tuple(d["pim"]["ops"])})) if "pim" in d else None
        link, over, energy = d.get("link", {}), d.get("overhead", {}), d.get("energy", {})
        return Hardware(name=d.get("name", name), description=d.get("description", name), tiers=tiers,
                        flops={k: float(v) for k, v in d["flops"].items()}, chips=int(d.get("chips", 1)),
                        tensor_parallel=int(d.get("tensor_parallel", 8)),
                        link_bandwidth=float(link.get("bandwidth", 0.0)), link_latency=float(link.get("latency", 0.0)),
                        step_overhead=float(over.get("step_s", 0.0)), layer_overhead=float(over.get("layer_s", 0.0)),
                        group_overhead=float(over.get("group_s", 0.0)),
                        gather_overhead=float(over.get("gather_s", 0.0)),
                        prefill_call_overhead=float(over.get("prefill_call_s", 0.0)),
                        prefill_layer_overhead=float(over.get("prefill_layer_s", 0.0)),
                        token_overhead=float(over.get("token_s", 0.0)),
                        kernel_bandwidth={k: float(v) for k, v in d.get("kernel_bandwidth", {}).items()},
                        weight_only_flops={k: float(v) for k, v in d.get("weight_only_flops", {}).items()},
                        activation_bandwidth=float(d.get("activation_bandwidth", 0.0)),
                        gather_bandwidth=float(d.get("gather_bandwidth", 0.0)),
                        paged_kernel=d.get("paged_kernel", "fused"), pj_per_flop=energy.get("pj_per_flop"),
                        pim=pim, source=source)
    except (KeyError, TypeError, ValueError) as e:
        raise TokenhaulError(f"hardware profile '{name}' is malformed: {e}") from None


def load_hardware(name: str) -> Hardware:
    """A named profile (`this-machine` / `this-machine-cuda` calibrate here, cached) or a path to a TOML profile."""
    if name in (THIS_MACHINE, THIS_MACHINE_CUDA):
        from tokenhaul.whatif.machine import this_machine

        return this_machine(device="cuda" if name == THIS_MACHINE_CUDA else "cpu")
    path = Path(name) if name.endswith(".toml") else HARDWARE_DIR / f"{name}.toml"
    if not path.is_file():
        raise TokenhaulError(f"unknown hardware '{name}' (choose from {', '.join(profile_names())}, "
                             f"or a path to a .toml profile)")
    return from_dict(tomllib.loads(path.read_text()), path.stem, str(path))
