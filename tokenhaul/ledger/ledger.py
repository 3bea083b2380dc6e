"""Ledger: the observer of every step and every delivered token. It records; it never steers."""

from __future__ import annotations

import time
from collections import defaultdict
from dataclasses import dataclass, field

from tokenhaul.engine.core import StepRecord
from tokenhaul.engine.request import Request
from tokenhaul.ledger.costs import ModelCosts, StepCosts, step_costs

ENGINE_STAGES = ("schedule", "prepare", "forward", "sample", "update")
FRONT_STAGES = ("detokenize", "deliver")


@dataclass
class TokenEvent:
    step: int  # index of the step that produced it
    t: float  # perf_counter when the front end delivered it
    detokenize_s: float = 0.0


@dataclass
class StepEntry:
    record: StepRecord
    costs: StepCosts

    @property
    def seconds(self) -> float:
        return sum(self.record.stage_seconds.values())

    @property
    def is_prefill(self) -> bool:
        return any(n > 1 for _, _, n in self.record.chunks)


@dataclass
class Ledger:
    costs: ModelCosts
    steps: list[StepEntry] = field(default_factory=list)
    tokens: dict[str, list[TokenEvent]] = field(default_factory=lambda: defaultdict(list))
    finished: dict[str, float] = field(default_factory=dict)
    front_seconds: dict[str, float] = field(default_factory=lambda: defaultdict(float))

    # observer interface (engine core) ------------------------------------------------------
    def on_step(self, record: StepRecord) -> None:
        chunks = [(start, n) for _, start, n in record.chunks]
        self.steps.append(StepEntry(record, step_costs(self.costs, chunks, len(record.sampled))))

    def on_finish(self, request: Request) -> None:
        self.finished[request.request_id] = time.perf_counter()

    # front-end interface ----------------------------------------------------------------------
    def on_token(self, request_id: str, step: int, detokenize_s: float, deliver_s: float = 0.0) -> None:
        self.tokens[request_id].append(TokenEvent(step, time.perf_counter(), detokenize_s))
        self.front_seconds["detokenize"] += detokenize_s
        self.front_seconds["deliver"] += deliver_s

    # reading ----------------------------------------------------------------------------------
    def summary(self) -> dict:
        """The short form: throughput, bytes per token, seconds per stage."""
        prefill = [s for s in self.steps if s.is_prefill]
        decode = [s for s in self.steps if not s.is_prefill]
        prefill_tokens = sum(n for s in prefill for _, _, n in s.record.chunks)
        decode_tokens = sum(len(s.record.sampled) for s in decode)
        generated = sum(len(s.record.sampled) for s in self.steps)
        stage: dict[str, float] = defaultdict(float)
        for s in self.steps:
            for k, v in s.record.stage_seconds.items():
                stage[k] += v
        stage.update(self.front_seconds)
        decode_s = sum(s.seconds for s in decode)
        decode_weight = sum(s.costs.weight_bytes for s in decode)
        decode_kv = sum(s.costs.kv_read_bytes + s.costs.kv_write_bytes for s in decode)
        return {
            "steps": len(self.steps),
            "prompt_tokens": prefill_tokens,
            "generated_tokens": generated,
            "prefill_tokens_per_s": _rate(prefill_tokens, sum(s.seconds for s in prefill)),
            "decode_tokens_per_s": _rate(decode_tokens, decode_s),
            "weight_bytes_per_token": decode_weight / decode_tokens if decode_tokens else 0.0,
            "kv_bytes_per_token": decode_kv / decode_tokens if decode_tokens else 0.0,
            "decode_gb_per_s": _rate(sum(s.costs.total_bytes for s in decode), decode_s) / 1e9,
            "stage_seconds": dict(stage),
        }

    def short_line(self) -> str:
        s = self.summary()
        return (f"prefill {s['prompt_tokens']} tok @ {s['prefill_tokens_per_s']:.0f} tok/s | "
                f"decode {s['generated_tokens']} tok @ {s['decode_tokens_per_s']:.1f} tok/s | "
                f"{s['weight_bytes_per_token'] / 1e6:.0f} MB weights + {s['kv_bytes_per_token'] / 1e6:.2f} MB KV "
                f"read per token ({s['decode_gb_per_s']:.1f} GB/s)")


def _rate(n: float, seconds: float) -> float:
    return n / seconds if seconds > 0 else 0.0
