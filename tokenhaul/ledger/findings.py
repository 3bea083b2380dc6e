"""Findings: the ledger's answers to the five seed questions, in plain words with figures, and the
four costs (compute, memory traffic, synchronisation, error/rollback) that any optimisation moves."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from tokenhaul.ledger.costs import TIERS
from tokenhaul.ledger.ledger import ENGINE_STAGES, FRONT_STAGES, Ledger, percentile

if TYPE_CHECKING:
    from tokenhaul.whatif.roofline import Roofline

COORDINATION = ("schedule", "prepare", "update", "between steps")
DRAM_TIERS = ("weight_bytes", "kv_read_bytes", "kv_write_bytes", "kv_copy_bytes")  # compulsory traffic
CHIP_TIERS = ("kv_gather_bytes", "activation_bytes", "logits_bytes", "metadata_bytes")  # cache-sized
HOST_TIERS = ("h2d_bytes", "d2h_bytes")
SMALL = 0.05  # a share below this is "not a source"


@dataclass
class Finding:
    question: str
    answer: str
    figures: dict[str, float]


def stage_shares(ledger: Ledger) -> dict[str, float]:
    """Seconds per stage plus the time between steps; their sum is the wall time of the run."""
    s = {k: ledger.stage_seconds.get(k, 0.0) for k in ENGINE_STAGES + FRONT_STAGES}
    s["between steps"] = ledger.between_steps_seconds
    return s


def four_costs(ledger: Ledger, roof: Roofline) -> dict[str, float]:
    """Per generated token. compute and memory as work and as the least time the machine needs for
    it; synchronisation as the measured host coordination between stages; rollback as the work
    thrown away (tokens recomputed after preemption, rejected speculative tokens) and its time."""
    p, d = ledger.prefill, ledger.decode
    n = max(1, p.sampled + d.sampled)
    flops = p.costs.flops + d.costs.flops
    dram = p.costs.dram_bytes + d.costs.dram_bytes
    sh = stage_shares(ledger)
    computed = p.tokens + d.tokens
    redo = ledger.recomputed_tokens / p.tokens * p.forward_seconds if p.tokens else 0.0
    rejected = ledger.rejected_tokens / computed * (p.forward_seconds + d.forward_seconds) if computed else 0.0
    return {
        "compute_flops": flops / n,
        "compute_s": roof.compute_seconds(flops) / n,
        "memory_bytes": dram / n,
        "memory_s": roof.data_seconds(dram) / n,
        "sync_s": sum(sh[k] for k in COORDINATION) / n,
        "rollback_tokens": (ledger.recomputed_tokens + ledger.rejected_tokens) / n,
        "rollback_s": (redo + rejected) / n,
    }


def moved(before: dict[str, float], after: dict[str, float], threshold: float = SMALL) -> dict[str, float]:
    """Which of the four costs an optimisation moved: relative change per cost beyond `threshold`
    (both arguments from `four_costs`, e.g. of two runs before and after a change)."""
    out = {}
    for key in ("compute_flops", "memory_bytes", "sync_s", "rollback_tokens"):
        a, b = before[key], after[key]
        change = (b - a) / a if a else (0.0 if b == 0 else float("inf"))
        if abs(change) > threshold:
            out[key] = change
    return out


def findings(ledger: Ledger, roof: Roofline) -> list[Finding]:
    return [_data(ledger, roof), _tiers(ledger), _last_mile(ledger), _stages(ledger), _costs(ledger, roof)]


def _data(ledger: Ledger, roof: Roofline) -> Finding:
    parts, fig = [], {}
    for name, ph in (("decode", ledger.decode), ("prefill", ledger.prefill)):
        if not ph.steps:
            continue
        pos = ph.position(roof)
        comp = roof.compute_seconds(ph.costs.flops) / ph.forward_seconds if ph.forward_seconds else 0.0
        rest = max(0.0, 1 - max(pos.data_fraction, comp))
        bound = "memory-bound" if pos.data_fraction >= comp else "compute-bound"
        parts.append(f"{name}: waiting on data {pos.data_fraction:.0%} of forward time, computing "
                     f"{comp:.0%}, neither {rest:.0%} (per-op overhead, stalls, other load); "
                     f"{pos.gb_per_s:.1f} GB/s of "
                     f"{roof.bandwidth / 1e9:.1f}, {pos.gflop_per_s:.1f} GFLOP/s, intensity "
                     f"{pos.intensity:.2f} FLOP/B → {bound}, {pos.roofline_fraction:.0%} of the roofline")
        fig |= {f"{name}_data_fraction": pos.data_fraction, f"{name}_compute_fraction": comp,
                f"{name}_roofline_fraction": pos.roofline_fraction}
    return Finding("How much of a step is waiting on data versus computing?",
                   "; ".join(parts) or "no steps recorded", fig)


def _tiers(ledger: Ledger) -> Finding:
    d = ledger.decode if ledger.decode.sampled else ledger.prefill
    n = max(1, d.sampled)
    per = {k: getattr(d.costs, k) / n for k, _ in TIERS}
    label = dict(TIERS)

    def part(keys):
        return [(label[k], per[k]) for k in keys if per[k] > 0]

    dram, chip, host = part(DRAM_TIERS), part(CHIP_TIERS), part(HOST_TIERS)
    detok = percentile([e.detokenize_s for e in ledger.tokens], 50)

    def fmt(items):
        return ", ".join(f"{name} {v / 1e6:.3g} MB" for name, v in items)

    link = (f"{len(host)} across host↔device ({fmt(host)})" if host else
            "none across host↔device (one memory on a CPU)")
    text = (f"per generated token: {len(dram)} crossings of main memory ({fmt(dram)}); {len(chip)} more "
            f"through the caches ({fmt(chip)}); {link}; then the token id into text (detokenize p50 "
            f"{detok * 1e3:.3f} ms)")
    return Finding("How many times does a token's state cross a memory tier?", text,
                   per | {"crossings": len(dram) + len(chip) + len(host) + 1})


def _last_mile(ledger: Ledger) -> Finding:
    tok = list(ledger.tokens)
    detok = percentile([e.detokenize_s for e in tok], 99)
    deliver = percentile([e.deliver_s for e in tok], 99)
    mile = percentile([e.last_mile_s for e in tok if e.last_mile_s >= 0], 99)
    itl50, itl99 = percentile(ledger.itl, 50), percentile(ledger.itl, 99)
    share = (detok + deliver) / itl99 if itl99 else 0.0
    verdict = "yes" if share > SMALL else "no"
    return Finding("Is detokenization and delivery (the last mile) a tail-latency source?",
                   f"{verdict}: detokenize p99 {detok * 1e3:.3f} ms + deliver p99 {deliver * 1e3:.3f} ms = "
                   f"{share:.1%} of ITL p99 {itl99 * 1e3:.1f} ms (p50 {itl50 * 1e3:.1f} ms); step end → "
                   f"delivered p99 {mile * 1e3:.3f} ms",
                   {"detokenize_p99_s": detok, "deliver_p99_s": deliver, "last_mile_p99_s": mile,
                    "itl_p50_s": itl50, "itl_p99_s": itl99, "share_of_itl_p99": share})


def _stages(ledger: Ledger) -> Finding:
    sh = stage_shares(ledger)
    wall = sum(sh.values()) or 1.0
    top = max(sh, key=sh.get)
    coord = sum(sh[k] for k in COORDINATION) / wall
    ranked = sorted(sh.items(), key=lambda kv: -kv[1])
    text = ", ".join(f"{k} {v / wall:.1%}" for k, v in ranked if v > 0)
    if sh[top] / wall >= 0.5 and sh[top] / wall > coord:
        verdict = f"one stage: {top} ({sh[top] / wall:.0%} of wall time); coordination {coord:.1%}"
    else:
        verdict = f"coordination between stages: {coord:.0%} of wall time (largest stage {top} " \
                  f"{sh[top] / wall:.0%})"
    return Finding("Is the bottleneck one stage or the coordination between stages?",
                   f"{verdict} — {text}", {f"{k}_fraction": v / wall for k, v in sh.items()}
                   | {"coordination_fraction": coord, "wall_s": wall})


def _costs(ledger: Ledger, roof: Roofline) -> Finding:
    c = four_costs(ledger, roof)
    mc = ledger.costs
    bits = 8 * mc.layer_weight_bytes / mc.layer_params if mc.layer_params else 0
    if mc.packed:
        kinds = ", ".join(f"{n} {fmt}" for fmt, n in mc.weight_formats)
        quant = (f"weights run packed at {bits:.1f} bits per weight ({kinds} linears); the kernels read the packed "
                 f"bytes and dequantize on the fly — the error is the file's own where its blocks map exactly, "
                 f"else requantization error (measure it: tokenhaul eval ppl)")
    else:
        quant = f"weights run at {bits:.0f} bits, dequantized at load, so no error is added at run time"
    text = (f"compute {c['compute_flops'] / 1e9:.3g} GFLOP/token ({c['compute_s'] * 1e3:.2f} ms at peak); "
            f"memory traffic {c['memory_bytes'] / 1e6:.4g} MB/token ({c['memory_s'] * 1e3:.2f} ms at "
            f"{roof.bandwidth / 1e9:.1f} GB/s); synchronisation {c['sync_s'] * 1e3:.2f} ms/token of host "
            f"coordination; error/rollback {ledger.recomputed_tokens} tokens recomputed after "
            f"{ledger.num_preemptions} preemptions, {ledger.rejected_tokens} speculative tokens rejected "
            f"({c['rollback_s'] * 1e3:.2f} ms/token); quantization: {quant}")
    return Finding("Which of the four costs does this run pay (compute, memory, sync, rollback)?", text, c)
