"""The client's view of a run: latency percentiles, throughput and goodput, and the table that prints them."""

from __future__ import annotations

from typing import Any

import numpy as np

from tokenhaul.bench.loadgen.client import RequestResult


def _stats(xs: list[float]) -> dict[str, float | None]:
    if not xs:
        return {"mean": None, "p50": None, "p90": None, "p99": None, "max": None}
    a = np.asarray(xs) * 1e3
    return {"mean": float(a.mean()), "p50": float(np.percentile(a, 50)), "p90": float(np.percentile(a, 90)),
            "p99": float(np.percentile(a, 99)), "max": float(a.max())}


def summarize(results: list[RequestResult], wall_s: float, slo_ttft_ms: float | None = None,
              slo_tpot_ms: float | None = None, slo_e2e_ms: float | None = None,
              slo_itl_ms: float | None = None) -> dict[str, Any]:
    ok = [r for r in results if r.ok]
    out_tok = sum(r.output_tokens for r in ok)
    in_tok = sum(r.prompt_tokens for r in ok)

    def good(r: RequestResult) -> bool:
        return ((slo_ttft_ms is None or (r.ttft is not None and r.ttft * 1e3 <= slo_ttft_ms))
                and (slo_tpot_ms is None or r.tpot is None or r.tpot * 1e3 <= slo_tpot_ms)
                and (slo_e2e_ms is None or r.e2e * 1e3 <= slo_e2e_ms)
                and (slo_itl_ms is None or max(r.itls, default=0.0) * 1e3 <= slo_itl_ms))

    slos = {k: v for k, v in (("ttft_ms", slo_ttft_ms), ("tpot_ms", slo_tpot_ms), ("itl_ms", slo_itl_ms),
                              ("e2e_ms", slo_e2e_ms)) if v is not None}
    n_good = sum(good(r) for r in ok) if slos else None
    errors = [r.error for r in results if not r.ok]
    itl = _stats([x for r in ok for x in r.itls])
    return {
        "requests": len(results), "completed": len(ok), "failed": len(errors),
        "errors": sorted(set(e for e in errors if e))[:5],
        "wall_s": wall_s, "prompt_tokens": in_tok, "output_tokens": out_tok,
        "request_throughput": len(ok) / wall_s if wall_s > 0 else 0.0,
        "output_throughput": out_tok / wall_s if wall_s > 0 else 0.0,
        "total_token_throughput": (in_tok + out_tok) / wall_s if wall_s > 0 else 0.0,
        "slo": slos, "good_requests": n_good,
        "goodput": n_good / wall_s if n_good is not None and wall_s > 0 else None,
        "ttft_ms": _stats([r.ttft for r in ok if r.ttft is not None]),
        "tpot_ms": _stats([t for r in ok if (t := r.tpot) is not None]),
        "itl_ms": itl,
        "itl_p99_over_p50": itl["p99"] / itl["p50"] if itl["p50"] else None,
        "e2e_ms": _stats([r.e2e for r in ok]),
        "mean_in_flight": sum(r.e2e for r in ok) / wall_s if wall_s > 0 else 0.0,
        "per_replica": {name: _replica(rs, wall_s) for name in sorted({r.replica for r in ok if r.replica})
                        if (rs := [r for r in ok if r.replica == name]) and wall_s > 0},
    }


def _replica(rs: list[RequestResult], wall_s: float) -> dict[str, Any]:
    """The client's view of one replica: the requests it served, their throughput and latencies."""
    return {"completed": len(rs), "output_throughput": sum(r.output_tokens for r in rs) / wall_s,
            "ttft_ms": _stats([r.ttft for r in rs if r.ttft is not None]),
            "itl_ms": _stats([x for r in rs for x in r.itls])}


def _fmt(x: float | None, spec: str = ".1f") -> str:
    return "-" if x is None else format(x, spec)


def format_table(s: dict[str, Any]) -> str:
    lines = [f"completed {s['completed']}/{s['requests']} in {s['wall_s']:.2f} s | "
             f"{s['request_throughput']:.2f} req/s | output {s['output_throughput']:.1f} tok/s | "
             f"total {s['total_token_throughput']:.1f} tok/s | {s['mean_in_flight']:.1f} in flight on average"]
    if s["slo"]:
        slo = " ".join(f"{k[:-3]}≤{v:g}ms" for k, v in s["slo"].items())
        lines.append(f"goodput {s['goodput']:.2f} req/s ({s['good_requests']}/{s['completed']} meet {slo})")
    lines.append(f"{'ms':<6}{'mean':>10}{'p50':>10}{'p90':>10}{'p99':>10}{'max':>10}")
    for k in ("ttft", "tpot", "itl", "e2e"):
        st = s[f"{k}_ms"]
        lines.append(f"{k.upper():<6}" + "".join(f"{_fmt(st[q]):>10}" for q in ("mean", "p50", "p90", "p99", "max")))
    lines.append(f"ITL p99/p50 {_fmt(s['itl_p99_over_p50'], '.2f')}")
    if s.get("prefix_hit_rate") is not None:
        lines.append(f"prefix cache hit rate {s['prefix_hit_rate']:.1%} of prompt tokens (all replicas)")
    if len(s.get("per_replica") or {}) > 1 or s.get("ledger"):
        lines.append(_replica_table(s))
    led = s.get("ledger")
    if led:
        miss = led["prefix_miss"]
        lines.append(f"prefix-cache misses (all replicas): {miss['tokens']} prompt tokens computed, "
                     f"{miss['kv_bytes'] / 1e6:.1f} MB of KV written, {miss['bytes_moved'] / 1e9:.2f} GB moved, "
                     f"{miss['flops'] / 1e9:.0f} GFLOP")
        dup = led.get("duplicate_prefix")
        if dup is not None:
            lines.append(f"prefix computed again on a second replica (router's view): {dup['tokens']} tokens, "
                         f"{dup['kv_bytes'] / 1e6:.1f} MB of KV recomputed rather than reused")
    lm = s.get("last_mile_us_per_token")
    if lm is not None:
        lines.append(f"last mile (server front end) {lm['total']:.1f} µs/token = detokenize+stop "
                     f"{lm['detokenize']:.1f} + SSE framing {lm['frame']:.1f}")
    if s["errors"]:
        lines.append("errors: " + "; ".join(s["errors"]))
    return "\n".join(lines)


def _replica_table(s: dict[str, Any]) -> str:
    """One row per replica (client-side latencies, engine-side prefix figures) and the total."""
    rows = [f"{'replica':<8}{'req':>5}{'tok/s':>8}{'TTFT p50':>10}{'p99':>8}{'ITL p50':>9}{'p99':>8}"
            f"{'hit rate':>10}{'computed':>10}{'miss MB KV':>11}"]
    led = (s.get("ledger") or {}).get("per_replica", {})
    for name in sorted(set(s["per_replica"]) | set(led)):
        c, e = s["per_replica"].get(name), led.get(name)
        row = f"{name:<8}"
        row += (f"{c['completed']:>5}{c['output_throughput']:>8.1f}{_fmt(c['ttft_ms']['p50'], '.0f'):>10}"
                f"{_fmt(c['ttft_ms']['p99'], '.0f'):>8}{_fmt(c['itl_ms']['p50'], '.0f'):>9}"
                f"{_fmt(c['itl_ms']['p99'], '.0f'):>8}") if c else f"{0:>5}{'-':>8}{'-':>10}{'-':>8}{'-':>9}{'-':>8}"
        row += _ledger_cells(e)
        rows.append(row)
    t = s["ttft_ms"]
    rows.append(f"{'total':<8}{s['completed']:>5}{s['output_throughput']:>8.1f}{_fmt(t['p50'], '.0f'):>10}"
                f"{_fmt(t['p99'], '.0f'):>8}{_fmt(s['itl_ms']['p50'], '.0f'):>9}{_fmt(s['itl_ms']['p99'], '.0f'):>8}"
                + _ledger_cells(s.get("ledger")))
    return "\n".join(rows)


def _ledger_cells(e: dict[str, Any] | None) -> str:
    if not e:
        return f"{'-':>10}{'-':>10}{'-':>11}"
    hit = "-" if e["prefix_hit_rate"] is None else f"{e['prefix_hit_rate']:.1%}"
    return f"{hit:>10}{e['prompt_tokens_computed']:>10}{e['prefix_miss']['kv_bytes'] / 1e6:>11.1f}"
