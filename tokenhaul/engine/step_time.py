"""StepTimeModel: how long one engine step (prepare → forward → sample) takes, predicted from the
shape of its batch, so the scheduler can size prefill chunks to an inter-token budget.

    t = scale · (g(tokens) + c · (sampled rows, attention groups, query×key pairs, key slots))

g is piecewise linear between knots at 1, 2, 4, … tokens (a CPU GEMM is bandwidth-bound at a few
rows and compute-bound past a few dozen, so time is far from linear in tokens); g and c are fitted
once per machine | model | settings by timing real batches (engine/step_calibration.py). `scale`
follows the step times the core measures itself (an exponentially weighted mean of
log(measured / predicted)), so load on a shared machine moves the prediction while the fitted
shape stays. Token arithmetic only: no torch, no model."""

from __future__ import annotations

import bisect
import math
from dataclasses import dataclass, field

import numpy as np

from tokenhaul.engine.attention_calls import split_by_length

EXTRA = ("sampled", "groups", "qk_pairs", "kv_slots")
VERSION = 3  # 2: attention calls split by KV length; 3: decodes attend in the cache dtype. Older fits are refused


@dataclass
class StepShape:
    """The cost-relevant shape of one step, built chunk by chunk as the scheduler plans it.

    Attention calls are split as the runner splits them (engine/attention_calls.py): by query length,
    then by KV length, each call padded to its longest member; keys are read in whole blocks."""

    block_size: int
    tokens: int = 0
    sampled: int = 0
    lengths: dict[int, list[int]] = field(default_factory=dict)  # query length → KV length of each chunk
    _calls: dict[int, tuple[int, int]] = field(default_factory=dict, repr=False, compare=False)  # memo of calls()

    def add(self, start: int, num_tokens: int, sampled: int) -> None:
        """Count a chunk computing positions [start, start + num_tokens) and `sampled` lm_head rows (sampled, or
        giving prompt logprobs); mutates self."""
        self.tokens += num_tokens
        self.sampled += sampled
        self.lengths.setdefault(num_tokens, []).append(start + num_tokens)
        self._calls.pop(num_tokens, None)

    def with_chunk(self, start: int, num_tokens: int, sampled: int) -> StepShape:
        """A copy with one more chunk (self unchanged)."""
        s = StepShape(self.block_size, self.tokens, self.sampled, {q: list(v) for q, v in self.lengths.items()},
                      dict(self._calls))
        s.add(start, num_tokens, sampled)
        return s

    def calls(self) -> list[tuple[int, int, int]]:
        """(query length, members, padded key span) of each attention call, as the runner makes them."""
        out = []
        for q_len, lengths in sorted(self.lengths.items()):
            if q_len not in self._calls:
                runs = split_by_length(lengths, self.block_size, q_len)
                self._calls[q_len] = tuple((len(r), -(-max(lengths[i] for i in r) // self.block_size)
                                            * self.block_size) for r in runs)
            out += [(q_len, members, span) for members, span in self._calls[q_len]]
        return out

    def extra(self) -> list[float]:
        """The features beyond the token count, in EXTRA's order."""
        calls = self.calls()
        qk = sum(q * members * span for q, members, span in calls)
        slots = sum(members * span for _, members, span in calls)
        return [self.sampled, len(calls), qk, slots]


def default_knots(max_tokens: int) -> list[int]:
    """1, 2, 4, … below max_tokens, and max_tokens."""
    return [2**i for i in range(max(1, max_tokens).bit_length()) if 2**i < max_tokens] + [max_tokens]


class StepTimeModel:
    """Seconds per step = scale · (g(tokens) + coef · extra). `observe` refines scale from measured steps."""

    def __init__(self, knots: list[int], values: list[float] | np.ndarray, coef: list[float] | np.ndarray,
                 scale: float = 1.0, alpha: float = 0.2, scale_bounds: tuple[float, float] = (0.25, 8.0)) -> None:
        self.knots = [int(k) for k in knots]
        self.values = np.maximum.accumulate(np.asarray(values, dtype=np.float64))  # g is non-decreasing
        self.coef = np.asarray(coef, dtype=np.float64)
        if (len(self.knots) != len(self.values) or self.knots != sorted(set(self.knots)) or self.knots[0] < 1
                or self.coef.shape != (len(EXTRA),) or (self.coef < 0).any() or (self.values < 0).any()):
            raise ValueError("need increasing knots ≥ 1 with one non-negative value each and "
                             f"{len(EXTRA)} non-negative coefficients")
        self.scale = scale
        self.alpha = alpha  # weight of the newest step in the running log-ratio
        self.scale_bounds = scale_bounds
        self.num_observed = 0

    def features(self, shape: StepShape) -> np.ndarray:
        """[interpolation weights of shape.tokens over the knots…, *EXTRA]."""
        return np.concatenate([_hat(self.knots, shape.tokens), shape.extra()])

    def base(self, shape: StepShape) -> float:
        """The fitted prediction, before the online scale."""
        if shape.tokens == 0:
            return 0.0
        return float(_hat(self.knots, shape.tokens) @ self.values + self.coef @ shape.extra())

    def predict(self, shape: StepShape) -> float:
        return self.scale * self.base(shape)

    def observe(self, shape: StepShape, seconds: float) -> None:
        """Fold one measured step into the scale (mutates self.scale); one outlier moves it little."""
        base = self.base(shape)
        if base <= 0 or seconds <= 0:
            return
        lo, hi = self.scale_bounds
        ratio = min(max(seconds / base, lo), hi)
        self.scale = math.exp((1 - self.alpha) * math.log(self.scale) + self.alpha * math.log(ratio))
        self.num_observed += 1

    def max_chunk(self, shape: StepShape, start: int, remaining: int, cap: int, budget_s: float,
                  prompt_rows: range = range(0)) -> int:
        """Largest n ≤ min(remaining, cap) whose chunk [start, start + n) keeps the predicted step
        within budget_s (0 if even one token does not fit). Its lm_head rows: one sampled where it reaches the
        end, and the `prompt_rows` positions it holds (prompt logprobs). Predictions grow with n: binary search."""
        hi = min(remaining, cap)
        lo = 0
        while lo < hi:
            mid = (lo + hi + 1) // 2
            rows = int(mid == remaining) + len(range(max(start, prompt_rows.start), min(start + mid, prompt_rows.stop)))
            if self.predict(shape.with_chunk(start, mid, rows)) <= budget_s:
                lo = mid
            else:
                hi = mid - 1
        return lo

    @classmethod
    def fit(cls, shapes: list[StepShape], seconds: list[float], knots: list[int], **kw) -> StepTimeModel:
        """Non-negative least squares on relative error (each step weighs 1/its time), so short
        decode steps are fitted as closely as long prefill steps."""
        proto = cls(knots, [0.0] * len(knots), [0.0] * len(EXTRA))
        x = np.stack([proto.features(s) for s in shapes])
        y = np.asarray(seconds, dtype=np.float64)
        sol = _nnls(x / y[:, None], np.ones_like(y))
        return cls(knots, sol[:len(knots)], sol[len(knots):], **kw)

    def to_dict(self) -> dict:
        return {"extra": list(EXTRA), "version": VERSION, "knots": self.knots, "values": self.values.tolist(),
                "coef": self.coef.tolist()}

    @classmethod
    def from_dict(cls, d: dict, **kw) -> StepTimeModel:
        if d.get("extra") != list(EXTRA) or d.get("version") != VERSION:
            raise ValueError("step-time entry was fitted on other features")
        return cls(d["knots"], d["values"], d["coef"], **kw)

    def describe(self) -> str:
        g = ", ".join(f"{k}: {v * 1e3:.1f}" for k, v in zip(self.knots, self.values))
        c = self.coef
        return (f"g(tokens) ms {{{g}}} + {c[0] * 1e3:.3f} ms/sampled row + {c[1] * 1e3:.3f} ms/attention group + "
                f"{c[2] * 1e9:.2f} µs/1k qk pairs + {c[3] * 1e9:.2f} µs/1k key slots, × scale {self.scale:.2f}")


def _hat(knots: list[int], t: int) -> np.ndarray:
    """Weights interpolating linearly between the two knots around t (extrapolating past the ends)."""
    w = np.zeros(len(knots))
    if len(knots) == 1:
        w[0] = t / knots[0]
        return w
    i = min(max(bisect.bisect_right(knots, t) - 1, 0), len(knots) - 2)
    lam = (t - knots[i]) / (knots[i + 1] - knots[i])
    w[i], w[i + 1] = 1 - lam, lam
    return w


def _nnls(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """min ||a x - b|| with x ≥ 0, approximately: least squares, dropping the most negative
    coefficient until none is left (enough for six features; numpy has no NNLS)."""
    active = list(range(a.shape[1]))
    x = np.zeros(a.shape[1])
    while active:
        sol, *_ = np.linalg.lstsq(a[:, active], b, rcond=None)
        if (sol >= 0).all():
            x[:] = 0
            x[active] = sol
            return x
        active.pop(int(np.argmin(sol)))
    return x
