"""Chrome / Perfetto trace JSON (trace event format) from a ledger's recent steps and tokens.

Opens in ui.perfetto.dev or chrome://tracing: process "engine" has one track per stage, process
"requests" one track per request, and counter tracks carry KV blocks and bytes per step, and, when
the scheduler worked to an inter-token budget, the step's budget, predicted and measured time
(prepare + forward + sample, the span the step-time model predicts)."""

from __future__ import annotations

import json
from pathlib import Path

from tokenhaul.ledger.ledger import ENGINE_STAGES, FRONT_STAGES, Ledger

ENGINE, REQUESTS = 1, 2
_TID = {name: i + 1 for i, name in enumerate(ENGINE_STAGES + FRONT_STAGES)}


def _us(t: float, t0: float) -> float:
    return round((t - t0) * 1e6, 3)


def _meta(pid: int, tid: int | None, kind: str, name: str, sort: int | None = None) -> list[dict]:
    ev = [{"ph": "M", "pid": pid, "name": kind, "args": {"name": name}}]
    if tid is not None:
        ev[0]["tid"] = tid
        if sort is not None:
            ev.append({"ph": "M", "pid": pid, "tid": tid, "name": "thread_sort_index", "args": {"sort_index": sort}})
    return ev


def trace_events(ledger: Ledger) -> list[dict]:
    steps = list(ledger.steps)
    tokens = list(ledger.tokens)
    spans = {r.request_id: r for r in ledger.requests}
    times = ([s.record.t_start for s in steps] + [r.arrival_t for r in spans.values() if r.arrival_t]
             + [e.t - e.deliver_s - e.detokenize_s for e in tokens])
    t0 = min(times, default=ledger.t0)
    ev: list[dict] = _meta(ENGINE, None, "process_name", "engine") + _meta(REQUESTS, None, "process_name", "requests")
    for name, tid in _TID.items():
        ev += _meta(ENGINE, tid, "thread_name", name, tid)
    req_tid: dict[str, int] = {}

    def rtid(rid: str) -> int:
        if rid not in req_tid:
            req_tid[rid] = len(req_tid) + 1
            ev.extend(_meta(REQUESTS, req_tid[rid], "thread_name", rid, req_tid[rid]))
        return req_tid[rid]

    for s in steps:
        r, c = s.record, s.costs
        t = fwd_start = r.t_start
        for name in ENGINE_STAGES:
            dur = r.stage_seconds.get(name, 0.0)
            args = {"step": r.index}
            if name == "forward":
                fwd_start = t
                args |= {"tokens": s.num_tokens, "sampled": s.num_sampled, "dram_MB": c.dram_bytes / 1e6,
                         "GFLOP": c.flops / 1e9}
            ev.append({"ph": "X", "pid": ENGINE, "tid": _TID[name], "name": name, "ts": _us(t, t0),
                       "dur": round(dur * 1e6, 3), "args": args})
            t += dur
        for (rid, start, n), prompt in zip(r.chunks, s.prompt_chunks, strict=True):  # as the ledger judged them
            if prompt:
                label = f"prefill {start}:{start + n}"
            else:  # one new position, and any drafts it verifies
                label = f"decode @{start}" if n == 1 else f"decode {start}:{start + n}"
            ev.append({"ph": "X", "pid": REQUESTS, "tid": rtid(rid), "name": label, "ts": _us(fwd_start, t0),
                       "dur": round(r.stage_seconds.get("forward", 0.0) * 1e6, 3),
                       "args": {"step": r.index, "tokens": n}})
        for rid in r.preempted:
            ev.append({"ph": "i", "s": "t", "pid": REQUESTS, "tid": rtid(rid), "name": "preempted",
                       "ts": _us(r.t_start, t0)})
        ts = _us(r.t_start, t0)
        ev.append({"ph": "C", "pid": ENGINE, "name": "KV blocks", "ts": ts,
                   "args": {"used": r.kv_blocks_used, "cached": r.kv_blocks_cached}})
        ev.append({"ph": "C", "pid": ENGINE, "name": "bytes per step (MB)", "ts": ts,
                   "args": {"weights": c.weight_bytes / 1e6, "kv": c.kv_bytes / 1e6,
                            "kv gather": c.kv_gather_bytes / 1e6, "activations": c.activation_bytes / 1e6,
                            "host↔device": (c.h2d_bytes + c.d2h_bytes) / 1e6}})
        if r.predicted_s:  # planned under an inter-token budget (budget 0: no decode waiting, no bound)
            measured = sum(r.stage_seconds.get(k, 0.0) for k in ("prepare", "forward", "sample"))
            ev.append({"ph": "C", "pid": ENGINE, "name": "step time (ms)", "ts": ts,
                       "args": {"budget": r.budget_s * 1e3, "predicted": r.predicted_s * 1e3,
                                "measured": measured * 1e3}})
    for e in tokens:
        end = e.t
        start = end - e.deliver_s - e.detokenize_s
        ev.append({"ph": "X", "pid": ENGINE, "tid": _TID["detokenize"], "name": "detokenize",
                   "ts": _us(start, t0), "dur": round(e.detokenize_s * 1e6, 3),
                   "args": {"request": e.request_id, "step": e.step}})
        ev.append({"ph": "X", "pid": ENGINE, "tid": _TID["deliver"], "name": "deliver",
                   "ts": _us(end - e.deliver_s, t0), "dur": round(e.deliver_s * 1e6, 3),
                   "args": {"request": e.request_id, "step": e.step}})
        ev.append({"ph": "i", "s": "t", "pid": REQUESTS, "tid": rtid(e.request_id), "name": "token",
                   "ts": _us(end, t0), "args": {"step": e.step}})
    for rid, span in spans.items():
        if span.arrival_t is not None and span.first_step_t > span.arrival_t:
            ev.append({"ph": "X", "pid": REQUESTS, "tid": rtid(rid), "name": "queued",
                       "ts": _us(span.arrival_t, t0), "dur": round((span.first_step_t - span.arrival_t) * 1e6, 3)})
        if span.finish_t is not None:
            ev.append({"ph": "i", "s": "t", "pid": REQUESTS, "tid": rtid(rid), "name": f"finish: {span.finish_reason}",
                       "ts": _us(span.finish_t, t0), "args": {"ttft_ms": (span.ttft or 0.0) * 1e3,
                                                               "recomputed": span.recomputed,
                                                               "drafts_proposed": span.proposed,
                                                               "drafts_accepted": span.accepted,
                                                               "drafts_rejected": span.rejected}})
    return ev


def write_trace(ledger: Ledger, path: str | Path) -> Path:
    """Write the trace JSON to `path`; returns it."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"traceEvents": trace_events(ledger), "displayTimeUnit": "ms",
                                "otherData": {"model": ledger.costs.config.arch}}))
    return path
