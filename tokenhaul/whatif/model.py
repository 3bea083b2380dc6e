"""The analytic model: one engine step on a hardware profile, op by op.

Bytes and FLOPs come from ledger/costs.py (`step_costs`). Weights, then KV, are placed in the tiers
that hold them (fastest first; what does not fit spills to the next). Each op's time is
max(compute, memory of each tier it reads) — tiers stream in parallel — and a step adds the
interconnect (tensor / pipeline parallel collectives) and the fixed per-step and per-layer overheads.
PIM ops read their bytes at the memory's internal bandwidth and never cross the memory bus."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from tokenhaul.engine.attention_calls import attention_calls
from tokenhaul.errors import TokenhaulError
from tokenhaul.ledger.costs import ModelCosts, StepCosts, step_costs
from tokenhaul.whatif.hardware import Hardware
from tokenhaul.whatif.kernels import layer_shapes


@dataclass(frozen=True)
class Placement:
    """Where the resident bytes live: shares of weights and of KV per tier, and the chips used."""

    chips: int
    weight_share: dict[str, float]
    kv_share: dict[str, float]
    tp_max: int = 8  # chips per tensor-parallel group; beyond it, pipeline stages

    @property
    def tensor_parallel(self) -> int:
        return min(self.chips, self.tp_max)

    @property
    def pipeline_stages(self) -> int:
        return -(-self.chips // self.tensor_parallel)


def place(hw: Hardware, weight_bytes: float, kv_bytes: float) -> Placement:
    """Fill the holding tiers fastest first: weights, then KV. Chips: the profile's, or (chips = 0) as
    many as the bytes need. Raises TokenhaulError when the bytes cannot fit."""
    per_chip = hw.capacity
    chips = hw.chips or max(1, math.ceil((weight_bytes + kv_bytes) / per_chip))
    free = {t.name: t.capacity * chips for t in hw.holding_tiers}
    shares = []
    for total in (weight_bytes, kv_bytes):
        share, left = {}, total
        for name in free:
            put = min(left, free[name])
            free[name] -= put
            left -= put
            if put:
                share[name] = put / total
        if left > 1e-6 * max(total, 1.0):
            raise TokenhaulError(f"{hw.name}: {(weight_bytes + kv_bytes) / 1e9:.1f} GB of weights and KV do not fit "
                                 f"{chips} chip(s) × {per_chip / 1e9:.2f} GB")
        shares.append(share or {hw.holding_tiers[-1].name: 1.0})
    return Placement(chips, *shares, max(1, hw.tensor_parallel))


@dataclass
class StepTime:
    seconds: float = 0.0
    parts: dict[str, float] = field(default_factory=dict)  # seconds attributed to what bound each op
    bus_bytes: dict[str, float] = field(default_factory=dict)  # bytes read or written per tier
    pim_bytes: float = 0.0  # bytes read inside memory (never on the bus)
    flops: float = 0.0
    energy_j: float | None = 0.0

    def charge(self, part: str, seconds: float) -> None:
        self.parts[part] = self.parts.get(part, 0.0) + seconds
        self.seconds += seconds

    def add(self, other: StepTime) -> None:
        """Accumulate `other` into self (mutates self)."""
        for k, v in other.parts.items():
            self.charge(k, v)
        for k, v in other.bus_bytes.items():
            self.bus_bytes[k] = self.bus_bytes.get(k, 0.0) + v
        self.pim_bytes += other.pim_bytes
        self.flops += other.flops
        self.energy_j = None if self.energy_j is None or other.energy_j is None else self.energy_j + other.energy_j

    @property
    def bound(self) -> str:
        return max(self.parts, key=self.parts.get) if self.parts else "none"


class StepModel:
    """Times steps of one model with one weight format on one hardware profile."""

    def __init__(self, hw: Hardware, costs: ModelCosts, weight_format: str, placement: Placement,
                 block_size: int = 16) -> None:
        self.hw, self.costs, self.fmt, self.placement, self.block_size = hw, costs, weight_format, placement, block_size
        self.tiers = {t.name: t for t in hw.tiers}
        tp = placement.tensor_parallel
        self.flops_rate = hw.linear_flops(weight_format) * tp  # per pipeline stage, which run one after another
        self.attn_rate = hw.flops_for("attention") * tp

    def _memory(self, st: StepTime, nbytes: float, share: dict[str, float], eff: float = 1.0) -> tuple[str, float]:
        """Bytes read from their tiers in parallel: (binding tier, seconds); records bus bytes."""
        worst, part = 0.0, "memory"
        tp = self.placement.tensor_parallel
        for name, s in share.items():
            b = nbytes * s
            st.bus_bytes[name] = st.bus_bytes.get(name, 0.0) + b
            t = b / (self.tiers[name].bandwidth * eff * tp)
            if t > worst:
                worst, part = t, f"memory:{name}"
        return part, worst

    def _op(self, st: StepTime, flops: float, rate: float, nbytes: float, share: dict[str, float],
            eff: float = 1.0) -> None:
        st.flops += flops
        part, mem = self._memory(st, nbytes, share, eff)
        comp = flops / rate if rate else 0.0
        st.charge("compute" if comp >= mem else part, max(comp, mem))

    def step(self, chunks: list[tuple[int, int]], num_sampled: int, view_slots: int = 0) -> StepTime:
        """One step: chunks are (start position, tokens) per sequence, as the scheduler emits them."""
        hw, mc, c = self.hw, self.costs, self.costs.config
        sc: StepCosts = step_costs(mc, chunks, num_sampled, block_size=self.block_size, view_slots=view_slots)
        st = StepTime()
        if not chunks:
            return st
        T = sum(n for _, n in chunks)
        decode_only = all(n == 1 for _, n in chunks)
        w_share, kv_share = self.placement.weight_share, self.placement.kv_share
        eff = hw.kernel_bandwidth.get(self.fmt, 1.0)
        linear_flops = 2 * T * mc.layer_params
        head_flops = 2 * num_sampled * mc.lm_head_params
        attn_flops = sc.flops - linear_flops - head_flops
        pim = hw.pim
        if pim and "gemv" in pim.ops and decode_only and T <= pim.gemv_max_rows:
            self._pim(st, linear_flops + head_flops, sc.weight_bytes)
        else:
            layer_bytes, head_bytes = sc.weight_bytes - mc.lm_head_bytes * bool(num_sampled), mc.lm_head_bytes
            measured = self._measured_linears(T, num_sampled)
            if measured is None:
                self._op(st, linear_flops, self.flops_rate, layer_bytes, w_share, eff)
                self._op(st, head_flops, self.flops_rate, head_bytes * bool(num_sampled), w_share, eff)
            else:
                head_bytes *= bool(num_sampled)
                for flops, nbytes, (seconds, gemv) in zip((linear_flops, head_flops), (layer_bytes, head_bytes),
                                                          measured):
                    st.flops += flops
                    part, _ = self._memory(st, nbytes, w_share, eff)
                    st.charge(part if seconds < 1.5 * gemv else "compute", seconds)
        kv_bytes = sc.kv_read_bytes + sc.kv_write_bytes + sc.kv_copy_bytes
        if pim and "attention" in pim.ops and decode_only:
            self._pim(st, attn_flops, kv_bytes)
        else:
            self._op(st, attn_flops, self.attn_rate, kv_bytes, kv_share)
        if hw.paged_kernel == "gather" and sc.kv_gather_bytes:
            st.charge("memory:gather", sc.kv_gather_bytes / (hw.gather_bandwidth or self._fastest_bw()))
        elementwise = sc.activation_bytes + sc.logits_bytes
        st.charge("memory:activations", elementwise / (hw.activation_bandwidth or self._fastest_bw()))
        self._interconnect(st, T)
        calls = attention_calls([(n, start + n) for start, n in chunks], self.block_size)  # as the runner splits
        gathered = sum(len(call) > 1 for call in calls)
        prefill_calls = sum(chunks[call[0]][1] > 1 for call in calls)
        st.charge("overhead", hw.step_overhead + T * hw.token_overhead + c.num_layers * (
            hw.layer_overhead + max(0, len(calls) - prefill_calls - 1) * hw.group_overhead
            + bool(prefill_calls) * hw.prefill_layer_overhead + prefill_calls * hw.prefill_call_overhead
            + gathered * hw.gather_overhead))
        st.energy_j = self._energy(st)
        return st

    def _measured_linears(self, rows: int, sampled: int) -> tuple[tuple[float, float], ...] | None:
        """(seconds, seconds at one row) of the layers' linears over `rows` rows and of the lm_head over
        `sampled` rows, from kernels timed on this machine; None where the profile has none (or the
        weights are sparse or split over chips: then the roofline)."""
        timer, c = self.hw.linear_times, self.costs.config
        if timer is None or self.placement.chips != 1 or self.costs.sparsity:
            return None
        shapes = layer_shapes(c)
        head = (c.vocab_size, c.hidden_size)
        span = self.costs.weight_bytes_per_step  # every linear's weights between two calls of one of them
        parts = []
        for n, rows_ in (([(s, c.num_layers) for s in shapes], rows), ([(head, 1)], sampled)):
            times = [(timer(self.fmt, o, i, max(rows_, 1), span), timer(self.fmt, o, i, 1, span), k) for (o, i), k in n]
            if any(t is None for t, _, _ in times):
                return None
            parts.append((sum(t * k for t, _, k in times) * bool(rows_), sum(g * k for _, g, k in times) * bool(rows_)))
        return tuple(parts)

    def _pim(self, st: StepTime, flops: float, nbytes: float) -> None:
        """An op run inside memory: internal bandwidth and in-memory FLOP/s; nothing crosses the bus."""
        pim, tp = self.hw.pim, self.placement.tensor_parallel
        st.flops += flops
        st.pim_bytes += nbytes
        st.charge("pim", max(nbytes / (pim.internal_bandwidth * tp), flops / (pim.flops * tp)))

    def _fastest_bw(self) -> float:
        return max(t.bandwidth for t in self.hw.tiers) * self.placement.tensor_parallel

    def _interconnect(self, st: StepTime, tokens: int) -> None:
        """Tensor parallel: two all-reduces of the hidden states per layer (ring); pipeline: one hop per stage."""
        hw, p, c = self.hw, self.placement, self.costs.config
        if p.chips <= 1 or not hw.link_bandwidth:
            return
        msg = tokens * c.hidden_size * 2  # bf16 hidden states
        tp, pp = p.tensor_parallel, p.pipeline_stages
        seconds = 0.0
        if tp > 1:
            ring = 2 * (tp - 1) / tp * msg / hw.link_bandwidth + 2 * (tp - 1) * hw.link_latency
            seconds += 2 * c.num_layers * ring  # every stage's layers, one stage after another
        seconds += (pp - 1) * (msg / hw.link_bandwidth + hw.link_latency)
        st.charge("interconnect", seconds)

    def _energy(self, st: StepTime) -> float | None:
        hw = self.hw
        if hw.pj_per_flop is None:
            return None
        pj = st.flops * hw.pj_per_flop
        for name, b in st.bus_bytes.items():
            e = self.tiers[name].pj_per_byte
            if e is None:
                return None
            pj += b * e
        if st.pim_bytes:
            if hw.pim.pj_per_byte is None:
                return None
            pj += st.pim_bytes * hw.pim.pj_per_byte
        return pj * 1e-12
