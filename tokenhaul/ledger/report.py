"""Report: the ledger in plain text and as one self-contained HTML page (plots embedded as PNG).

Plots: per-token time stacked by stage, bytes per token by tier, the roofline with every recent
step on it, the inter-token latency histogram; then the five questions answered with figures."""

from __future__ import annotations

import base64
import html
import io
from pathlib import Path
from typing import TYPE_CHECKING

from tokenhaul.ledger.costs import TIERS
from tokenhaul.ledger.findings import findings, stage_shares
from tokenhaul.ledger.ledger import ENGINE_STAGES, FRONT_STAGES, Ledger

if TYPE_CHECKING:
    from tokenhaul.whatif.roofline import Roofline

COLORS = {"schedule": "#9e9e9e", "prepare": "#ffb74d", "forward": "#1976d2", "sample": "#7e57c2",
          "update": "#bdbdbd", "propose": "#f06292", "detokenize": "#43a047", "deliver": "#a5d6a7",
          "between steps": "#e57373"}


def text_report(ledger: Ledger, roof: Roofline | None = None) -> str:
    roof = roof or ledger.roofline()
    lines = [ledger.short_line(roof), f"machine: {roof.key}: {roof.bandwidth / 1e9:.1f} GB/s read, "
             f"{roof.peak_flops / 1e9:.0f} GFLOP/s fp32 GEMM; ran on {ledger.host['threads']} threads, OpenMP wait "
             f"{ledger.host['openmp_wait']}"]
    for i, f in enumerate(findings(ledger, roof), 1):
        lines.append(f"{i}. {f.question}\n   {f.answer}")
    return "\n".join(lines)


def _png(fig) -> str:
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=90, bbox_inches="tight")
    import matplotlib.pyplot as plt

    plt.close(fig)
    return base64.b64encode(buf.getvalue()).decode()


def per_token_stages(ledger: Ledger, steps) -> dict[str, list[float]]:
    """Seconds per generated token of each step, by stage; "between steps" is the gap before the
    next step less this step's front-end time (loop, observer and glue)."""
    by_index = {s.record.index: s for s in ledger.steps}
    out: dict[str, list[float]] = {k: [] for k in (*ENGINE_STAGES, *FRONT_STAGES, "between steps")}
    for s in steps:
        n = s.num_sampled or 1
        for k in ENGINE_STAGES:
            out[k].append(s.record.stage_seconds.get(k, 0.0) / n)
        out["detokenize"].append(s.detokenize_s / n)
        out["deliver"].append(s.deliver_s / n)
        nxt = by_index.get(s.record.index + 1)
        gap = nxt.gap_before if nxt is not None else 0.0
        out["between steps"].append(max(0.0, gap - s.detokenize_s - s.deliver_s) / n)
    return out


def _plots(ledger: Ledger, roof: Roofline) -> dict[str, str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = [s for s in ledger.steps if s.num_sampled]
    out = {}
    # per-token time stacked by stage
    fig, ax = plt.subplots(figsize=(9, 3.4))
    x = [s.record.index for s in steps]
    bottom = [0.0] * len(steps)
    for stage, vals in per_token_stages(ledger, steps).items():
        ax.bar(x, [v * 1e3 for v in vals], bottom=bottom, color=COLORS[stage], label=stage, width=1.0)
        bottom = [b + v * 1e3 for b, v in zip(bottom, vals)]
    ax.set_xlabel("step")
    ax.set_ylabel("ms per generated token")
    ax.set_title("Per-token time by stage")
    ax.legend(fontsize=7, ncol=4)
    out["stages"] = _png(fig)
    # bytes per token by tier
    ph = ledger.decode if ledger.decode.sampled else ledger.prefill
    n = max(1, ph.sampled)
    tiers = [(label, getattr(ph.costs, k) / n) for k, label in TIERS if getattr(ph.costs, k) > 0]
    fig, ax = plt.subplots(figsize=(9, 0.4 * len(tiers) + 1))
    ax.barh([t[0] for t in tiers], [t[1] / 1e6 for t in tiers], color="#1976d2")
    ax.set_xscale("log")
    ax.invert_yaxis()
    ax.set_xlabel("MB per generated token (log)")
    ax.set_title("Bytes per token by tier (decode)" if ph is ledger.decode else "Bytes per token (prefill)")
    out["tiers"] = _png(fig)
    # roofline
    fig, ax = plt.subplots(figsize=(6.5, 4.2))
    pts = [(s.costs.flops / s.costs.dram_bytes, s.costs.flops / s.record.stage_seconds["forward"] / 1e9,
            s.is_prefill) for s in ledger.steps if s.costs.dram_bytes and s.record.stage_seconds.get("forward")]
    lo = min([p[0] for p in pts] + [0.05]) / 2
    hi = max([p[0] for p in pts] + [roof.ridge * 4]) * 2
    grid = [lo * (hi / lo) ** (i / 200) for i in range(201)]
    ax.plot(grid, [roof.attainable(i) / 1e9 for i in grid], color="black", label="measured roof")
    for pre, color, name in ((False, "#1976d2", "decode steps"), (True, "#e65100", "prefill steps")):
        sel = [p for p in pts if p[2] is pre]
        if sel:
            ax.scatter([p[0] for p in sel], [p[1] for p in sel], s=12, color=color, label=name, alpha=0.7)
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("arithmetic intensity (FLOP / DRAM byte)")
    ax.set_ylabel("GFLOP/s (forward)")
    ax.set_title(f"Roofline: {roof.bandwidth / 1e9:.0f} GB/s, {roof.peak_flops / 1e9:.0f} GFLOP/s")
    ax.legend(fontsize=7)
    out["roofline"] = _png(fig)
    # ITL histogram
    fig, ax = plt.subplots(figsize=(6.5, 3.2))
    itl = [v * 1e3 for v in ledger.itl]
    ax.hist(itl or [0.0], bins=40, color="#43a047")
    ax.set_xlabel("inter-token latency (ms)")
    ax.set_ylabel("tokens")
    ax.set_title(f"ITL, {len(itl)} gaps")
    out["itl"] = _png(fig)
    return out


def html_report(ledger: Ledger, roof: Roofline | None = None, title: str = "tokenhaul ledger") -> str:
    roof = roof or ledger.roofline()
    s = ledger.summary(roof)
    esc = html.escape
    rows = "".join(f"<tr><td>{i}. {esc(f.question)}</td><td>{esc(f.answer)}</td></tr>"
                   for i, f in enumerate(findings(ledger, roof), 1))
    sh = stage_shares(ledger)
    wall = sum(sh.values()) or 1.0
    stage_rows = "".join(f"<tr><td>{esc(k)}</td><td>{v * 1e3:.2f}</td><td>{v / wall:.1%}</td></tr>"
                         for k, v in sh.items())
    keys = ("steps", "prompt_tokens", "generated_tokens", "decode_tokens", "prefill_tokens_per_s",
            "decode_tokens_per_s", "weight_bytes_per_token", "kv_bytes_per_token", "flops_per_token", "decode_gb_per_s",
            "roofline_fraction", "data_wait_fraction", "preemptions", "recomputed_tokens", "kv_blocks_peak")
    sum_rows = "".join(f"<tr><td>{k}</td><td>{s[k]:,.4g}</td></tr>" for k in keys)
    lat_rows = "".join(f"<tr><td>{k}</td><td>{s[k]['p50']:.3f}</td><td>{s[k]['p99']:.3f}</td>"
                       f"<td>{s[k]['n']}</td></tr>" for k in ("itl_ms", "ttft_ms", "detokenize_ms", "last_mile_ms"))
    imgs = "".join(f'<img alt="{k}" src="data:image/png;base64,{v}">' for k, v in _plots(ledger, roof).items())
    return f"""<!doctype html><html><head><meta charset="utf-8"><title>{esc(title)}</title><style>
body{{font-family:system-ui,sans-serif;max-width:1100px;margin:1em auto;color:#222}}
table{{border-collapse:collapse;margin:.6em 0}}td,th{{border:1px solid #ccc;padding:3px 8px;vertical-align:top}}
img{{display:block;margin:.8em 0;max-width:100%}}td:first-child{{white-space:nowrap}}</style></head><body>
<h1>{esc(title)}</h1>
<p>{esc(ledger.short_line(roof))}</p>
<p>Machine: {esc(roof.key)} — {roof.bandwidth / 1e9:.1f} GB/s read, {roof.peak_flops / 1e9:.0f} GFLOP/s
fp32 GEMM (tokenhaul calibrate). Bytes are analytic (ledger/costs.py); times are measured.</p>
<h2>The five questions</h2><table><tr><th>question</th><th>answer</th></tr>{rows}</table>
<h2>Where the time went</h2><table><tr><th>stage</th><th>ms</th><th>share</th></tr>{stage_rows}</table>
<table><tr><th>latency (ms)</th><th>p50</th><th>p99</th><th>n</th></tr>{lat_rows}</table>
<h2>Figures</h2><table>{sum_rows}</table>
{imgs}
</body></html>"""


def write_report(ledger: Ledger, path: str | Path, roof: Roofline | None = None,
                 title: str = "tokenhaul ledger") -> Path:
    """Write the HTML report to `path`; returns it."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(html_report(ledger, roof, title), encoding="utf-8")
    return path
