"""A workload (model, weight format, KV dtype, sparsity, batch, context, decoding) and its prediction.

`predict` replays the engine's scheduling rules in token arithmetic — running sequences first (one
token per decode, a chunk per unfinished prompt), then waiting prompts under the token budget — and
times every step with the StepModel. Phases are classified as the ledger does (a step with any chunk
longer than one token is prefill), so a prediction and a measured ledger compare like for like."""

from __future__ import annotations

from dataclasses import dataclass, field

from tokenhaul.engine.attention_calls import attention_calls
from tokenhaul.errors import TokenhaulError
from tokenhaul.ledger.costs import ModelCosts
from tokenhaul.models.config import ModelConfig
from tokenhaul.whatif.hardware import Hardware
from tokenhaul.whatif.model import StepModel, StepTime, place

WEIGHT_BITS = {  # stored bits per linear weight, scales included
    "fp32": 32.0, "bf16": 16.0, "fp16": 16.0, "fp8": 8.0,
    "int8": 8.0,  # per-channel: one scale per output row, negligible per weight
    "int4": 5.0,  # group 32 with a bf16 scale and a bf16 zero per group: 4 + 32/32
}
KV_BYTES = {"fp32": 4.0, "bf16": 2.0, "fp16": 2.0, "fp8": 1.0, "int8": 1.0625}  # int8: + one fp16 scale per 32


@dataclass(frozen=True)
class Decoding:
    """Greedy/sampling (one token per step), or speculative: `k` drafts verified in one step, each
    accepted with probability `acceptance`; a draft model's costs, or None (prompt lookup: free drafts)."""

    kind: str = "greedy"
    k: int = 4
    acceptance: float = 0.7
    draft: ModelCosts | None = None

    @property
    def tokens_per_step(self) -> float:
        """Expected tokens emitted per verify step: (1 - a^(k+1)) / (1 - a)."""
        if self.kind != "speculative":
            return 1.0
        a = self.acceptance
        return self.k + 1.0 if a >= 1.0 else (1 - a ** (self.k + 1)) / (1 - a)


def parse_decoding(spec: str) -> Decoding:
    """"greedy" or "speculative:k=4,a=0.7[,draft=MODEL]" (no draft: prompt lookup, drafts cost nothing)."""
    kind, _, rest = spec.partition(":")
    if kind not in ("greedy", "speculative"):
        raise TokenhaulError(f"unknown decoding '{spec}' (greedy | speculative:k=4,a=0.7[,draft=MODEL])")
    opts = dict(kv.split("=", 1) for kv in rest.split(",") if "=" in kv)
    try:
        k, a = int(opts.get("k", 4)), float(opts.get("a", 0.7))
    except ValueError:
        raise TokenhaulError(f"bad speculative options in '{spec}'") from None
    if kind == "speculative" and not (k >= 1 and 0.0 <= a <= 1.0):
        raise TokenhaulError("speculative decoding needs k >= 1 and 0 <= a <= 1")
    draft = None
    if "draft" in opts:
        from tokenhaul.whatif.modelspec import load_model_config

        draft = ModelCosts.from_config(load_model_config(opts["draft"])[1])
    return Decoding(kind, k, a, draft)


@dataclass(frozen=True)
class Workload:
    name: str
    config: ModelConfig
    batch: int = 1
    context: int = 512  # prompt tokens per sequence
    new_tokens: int = 128
    quantization: str = "bf16"
    kv_dtype: str = "bf16"
    sparsity: float = 0.0
    decoding: Decoding = field(default_factory=Decoding)
    max_batched_tokens: int = 512
    block_size: int = 16

    def __post_init__(self) -> None:
        if self.quantization not in WEIGHT_BITS:
            raise TokenhaulError(f"unknown quantization '{self.quantization}' (choose from {', '.join(WEIGHT_BITS)})")
        if self.kv_dtype not in KV_BYTES:
            raise TokenhaulError(f"unknown KV dtype '{self.kv_dtype}' (choose from {', '.join(KV_BYTES)})")
        if min(self.batch, self.context, self.new_tokens, self.max_batched_tokens) < 1:
            raise TokenhaulError("batch, context, new tokens and max batched tokens must be positive")
        if not 0.0 <= self.sparsity < 1.0:
            raise TokenhaulError(f"sparsity must be in [0, 1), got {self.sparsity}")

    def costs(self) -> ModelCosts:
        return ModelCosts.from_config(self.config, WEIGHT_BITS[self.quantization], KV_BYTES[self.kv_dtype],
                                      self.sparsity)

    @property
    def resident_weight_bytes(self) -> float:
        mc, c = self.costs(), self.config
        embed = 0 if c.tie_embeddings else c.vocab_size * mc.embed_row_bytes
        return mc.weight_bytes_per_step + embed

    @property
    def resident_kv_bytes(self) -> float:
        return self.batch * (self.context + self.new_tokens) * self.costs().kv_bytes_per_token


@dataclass
class PhaseTime:
    steps: int = 0
    tokens: int = 0  # computed
    sampled: int = 0
    time: StepTime = field(default_factory=StepTime)

    @property
    def seconds(self) -> float:
        return self.time.seconds


@dataclass
class Prediction:
    workload: Workload
    hardware: Hardware
    chips: int
    prefill: PhaseTime
    decode: PhaseTime
    ttft_s: float  # until every sequence of the batch has its first token (they arrive together)
    tpot_s: float  # mean decode step: time per output token of one user
    weight_share: dict[str, float]
    kv_share: dict[str, float]

    @property
    def decode_tokens_per_s(self) -> float:
        return 1.0 / self.tpot_s if self.tpot_s else 0.0

    @property
    def aggregate_tokens_per_s(self) -> float:
        return self.workload.batch * self.decode_tokens_per_s

    @property
    def prefill_tokens_per_s(self) -> float:
        return self.prefill.tokens / self.prefill.seconds if self.prefill.seconds else 0.0

    @property
    def energy_j_per_token(self) -> float | None:
        e = self.decode.time.energy_j
        return None if e is None or not self.decode.sampled else e / self.decode.sampled

    def as_dict(self) -> dict:
        w = self.workload
        return {
            "model": w.name, "hardware": self.hardware.name, "chips": self.chips, "batch": w.batch,
            "context": w.context, "new_tokens": w.new_tokens, "quantization": w.quantization, "kv_dtype": w.kv_dtype,
            "sparsity": w.sparsity, "decoding": w.decoding.kind, "ttft_s": self.ttft_s, "tpot_s": self.tpot_s,
            "decode_tokens_per_s": self.decode_tokens_per_s, "aggregate_tokens_per_s": self.aggregate_tokens_per_s,
            "prefill_tokens_per_s": self.prefill_tokens_per_s, "energy_j_per_token": self.energy_j_per_token,
            "bound": {"prefill": self.prefill.time.bound, "decode": self.decode.time.bound},
            "seconds_by_part": {"prefill": dict(self.prefill.time.parts), "decode": dict(self.decode.time.parts)},
            "weight_placement": self.weight_share, "kv_placement": self.kv_share,
        }


def schedule(w: Workload):
    """Yield (chunks, num_sampled, view_slots) per step, as the engine's scheduler would run `w`:
    all sequences arrive together, prompts are chunked under the token budget, then decode to the end."""
    todo = [w.context] * w.batch  # tokens to compute before the next sample
    pos = [0] * w.batch
    made = [0] * w.batch
    running: list[int] = []
    waiting = list(range(w.batch))
    bs = w.block_size
    mc = w.costs()
    while running or waiting:
        budget, chunks, sampled, view = w.max_batched_tokens, [], 0, 0
        for i in running + waiting:
            if budget <= 0:
                break
            n = min(todo[i], budget)
            if i in waiting:
                waiting.remove(i)
                running.append(i)
            chunks.append((i, pos[i], n))
            budget -= n
        # as engine/runner.py: a call of one sequence (its blocks consecutive) reads them as a view, unless
        # the C++ kernel reads its queries in place (decodes, and every query under --deterministic)
        for call in attention_calls([(n, start + n) for _, start, n in chunks], bs):
            _, start, n = chunks[call[0]]
            if len(call) == 1 and not (mc.decodes_in_place and (n == 1 or mc.queries_in_place)):
                view += -(-(start + n) // bs) * bs
        for i, _, n in chunks:
            pos[i] += n
            todo[i] -= n
            if todo[i] == 0:
                sampled += 1
                made[i] += 1
                todo[i] = 1
                if made[i] >= w.new_tokens:
                    running.remove(i)
        yield [(s, n) for _, s, n in chunks], sampled, view


def predict(w: Workload, hw: Hardware) -> Prediction:
    mc = w.costs()
    placement = place(hw, w.resident_weight_bytes, w.resident_kv_bytes)
    model = StepModel(hw, mc, w.quantization, placement, w.block_size)
    prefill, decode = PhaseTime(), PhaseTime()
    ttft = elapsed = 0.0
    first = 0
    for chunks, sampled, view in schedule(w):
        st = model.step(chunks, sampled, view)
        elapsed += st.seconds
        phase = prefill if any(n > 1 for _, n in chunks) else decode
        phase.steps += 1
        phase.tokens += sum(n for _, n in chunks)
        phase.sampled += sampled
        phase.time.add(st)
        if first < w.batch:
            first += sum(1 for s, n in chunks if s + n == w.context)
            ttft = elapsed
    tpot = decode.seconds / decode.steps if decode.steps else 0.0
    if w.decoding.kind == "speculative" and decode.steps:
        tpot = _speculative_tpot(w, hw, model, tpot)
    return Prediction(w, hw, placement.chips, prefill, decode, ttft, tpot,
                      placement.weight_share, placement.kv_share)


def _speculative_tpot(w: Workload, hw: Hardware, model: StepModel, tpot: float) -> float:
    """Per verify step: k draft steps (free with prompt lookup) plus one step computing k+1 tokens per
    sequence at mid-generation context; divided by the expected tokens it emits."""
    d = w.decoding
    mid = w.context + w.new_tokens // 2
    verify = model.step([(mid, d.k + 1)] * w.batch, w.batch).seconds
    draft = 0.0
    if d.draft is not None:
        dm = StepModel(hw, d.draft, w.quantization, place(hw, d.draft.weight_bytes_per_step, 0.0), w.block_size)
        draft = d.k * dm.step([(mid, 1)] * w.batch, w.batch).seconds
    return (verify + draft) / d.tokens_per_step
