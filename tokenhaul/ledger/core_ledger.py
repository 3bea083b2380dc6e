"""CoreLedger: the ledger of one serving engine core (in this process, or inside a Ray replica),
fed by the core's step thread and read from another, so each record and each reading holds a lock.

A core has no front end of its own here: a token counts as delivered when the step that sampled it
ends (arrival at the core → that step is the core-side TTFT; the HTTP and Ray hops come on top).
`snapshot()` gives plain dicts (no torch, no ledger objects), so they cross a Ray actor boundary
and go out as JSON: running totals, the bytes a prefix-cache miss cost, and the latest step records."""

from __future__ import annotations

import dataclasses
import threading
from typing import Any

from tokenhaul.engine.core import StepRecord
from tokenhaul.engine.request import Request
from tokenhaul.ledger.costs import ModelCosts, prefix_miss_cost
from tokenhaul.ledger.ledger import Ledger, _pcts


class CoreLedger:
    """Attach as `core.observer`; read with `snapshot()` from any thread."""

    def __init__(self, costs: ModelCosts, max_steps: int = 1024) -> None:
        self.ledger = Ledger(costs, max_steps=max_steps)
        self._lock = threading.Lock()
        self.prompt_tokens = 0  # prompt tokens of finished requests ...
        self.cached_tokens = 0  # ... of which served from the prefix cache

    # observer (the core's step thread) ------------------------------------------------------------
    def on_step(self, record: StepRecord) -> None:
        with self._lock:
            self.ledger.on_step(record)
            for rid in record.sampled:
                self.ledger.on_token(rid, record.index, 0.0)

    def on_finish(self, request: Request) -> None:
        with self._lock:
            self.ledger.on_finish(request)
            self.prompt_tokens += request.num_prompt_tokens
            self.cached_tokens += request.num_cached_tokens

    # reading (any thread) -------------------------------------------------------------------------
    def snapshot(self, since: int | None = None, max_steps: int = 1024) -> dict[str, Any]:
        """Totals since start and, unless `since` is None, the step records with index > since (at
        most `max_steps`, the latest) as dicts with their bytes, FLOPs and engine seconds. Only copies
        are taken under the lock (the step thread waits for those alone, not for the conversion)."""
        with self._lock:
            lg = self.ledger
            p, d = lg.prefill, lg.decode
            entries = [] if since is None else [e for e in lg.steps if e.record.index > since][-max_steps:]
            ttft = [r.ttft for r in lg.requests if r.ttft is not None]
            itl = list(lg.itl)
            out = {
                "steps": lg.num_steps,
                "last_step": lg.steps[-1].record.index if lg.steps else -1,
                "prompt_tokens_computed": lg.prompt_tokens,  # prompt positions computed (cache hits excluded)
                "generated_tokens": p.sampled + d.sampled,
                "decode_tokens": d.sampled,  # of which sampled in decode steps: what decode_tokens_per_s counts
                "recomputed_tokens": lg.recomputed_tokens,  # lost to preemption, computed again
                "preemptions": lg.num_preemptions,
                "engine_seconds": p.seconds + d.seconds,
                "prefill_tokens_per_s": p.tokens / p.seconds if p.seconds else 0.0,
                "decode_tokens_per_s": d.sampled / d.seconds if d.seconds else 0.0,
                "prefill_bytes": p.costs.total_bytes, "prefill_flops": p.costs.flops, "prefill_tokens": p.tokens,
                "decode_bytes": d.costs.total_bytes,
                "kv_bytes_per_token": lg.costs.kv_bytes_per_token,
                "finished_prompt_tokens": self.prompt_tokens,
                "finished_cached_tokens": self.cached_tokens,
                "host": dict(lg.host),
            }
        out["ttft_ms"], out["itl_ms"] = _pcts(ttft), _pcts(itl)  # core side: arrival at the core → sampled
        out["prefix_miss"] = prefix_miss(out)
        out["step_records"] = [_step_dict(e) for e in entries]  # records and costs are not changed once logged
        return out


def prefix_miss(snap: dict[str, Any]) -> dict[str, float]:
    """The cost of the prefix-cache misses of a snapshot's (or a difference of two's) finished requests."""
    return prefix_miss_cost(snap["finished_prompt_tokens"] - snap["finished_cached_tokens"], snap["kv_bytes_per_token"],
                            snap["prefill_bytes"], snap["prefill_flops"], snap["prefill_tokens"])


def _step_dict(e) -> dict[str, Any]:
    d = dataclasses.asdict(e.record)
    d.pop("attn_groups", None)  # per-sequence KV lengths: large, and the costs below already count them
    return d | {"seconds": e.seconds, "bytes": e.costs.total_bytes, "flops": e.costs.flops,
                "prefill": e.is_prefill}
