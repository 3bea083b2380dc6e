"""Analytic bytes and FLOPs per step, per tier — the one source of truth for every count printed.

Every field of `StepCosts` is traffic (bytes moved), not a tensor size. The model is the code as
written today (layers/attention.py, engine/runner.py): paged attention gathers each group's K/V, in
whole blocks and padded to the group's longest block table, into a contiguous copy per layer, then
attention reads that copy — except decodes on int8 and bf16 caches on the CPU, which read each
sequence's own blocks in place (kv/decode_attention.py); the runner builds token ids, positions,
block tables and masks on the host and moves them to the device once.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields

import torch

from tokenhaul.decoding.prompt_logprobs import ROWS as PROMPT_ROWS
from tokenhaul.engine.attention_calls import attention_calls
from tokenhaul.layers.attention import decodes_in_place
from tokenhaul.models.config import ModelConfig

ID_BYTES = 8  # torch.long: token ids, positions, slots, row indices
MASK_BYTES = 1  # torch.bool


def _kv_dtype(kv_itemsize: float) -> torch.dtype:
    """The cache dtype of `kv_itemsize` stored bytes a value (int8's include its scales' share)."""
    return torch.int8 if kv_itemsize < 2 else torch.bfloat16 if kv_itemsize == 2 else torch.float32


@dataclass(frozen=True)
class ModelCosts:
    """Per-model constants, taken from the loaded tensors (so quantized layouts count right)."""

    config: ModelConfig
    layer_weight_bytes: int  # every linear of every layer, read once per step
    lm_head_bytes: int
    embed_row_bytes: int  # one embedding row
    norm_bytes: int
    kv_bytes_per_token: int  # K and V of one token, all layers, at the cache dtype
    layer_params: int  # multiply-adds per token through the layers' linears
    lm_head_params: int
    activation_itemsize: int = 4
    kv_itemsize: float = 4  # stored bytes per K/V value (int8: 1 + its share of the per-token-per-head scale)
    compute_itemsize: int = 4  # attention runs in fp32: the gathered K/V is converted to it
    device: str = "cpu"
    kv_quantized: bool = False  # int8 K/V: prefill chunks dequantize a copy (kv/int8.py)
    # decodes read each sequence's own blocks in place (kv/decode_attention.py: int8 and bf16 caches on the CPU;
    # layers/attention.decodes_in_place), not a gathered copy padded to the group's longest table
    decodes_in_place: bool = False
    queries_in_place: bool = False  # --deterministic: every prefill query read in place as a decode of its own
    # activation sparsity (layers/linear_sparse.py): the share of inputs zeroed, and per "most rows the gathered
    # kernel runs" the bytes of the sparse projections' input-channel rows (inside layer_weight_bytes)
    sparsity: float = 0.0
    sparse_rows: tuple[tuple[int, int], ...] = ()  # (max_rows, row bytes)
    sparse_params: tuple[tuple[int, int], ...] = ()  # (max_rows, multiply-adds per row of those projections)
    lm_head_max_rows: int = 0  # a sparse lm_head gathers its kept input rows up to this many sampled rows

    @property
    def sparse_row_bytes(self) -> int:
        return sum(b for _, b in self.sparse_rows)
    # (storage format, linears in it), lm_head included; a description, not a cost (equality ignores it)
    weight_formats: tuple[tuple[str, int], ...] = field(default=(), compare=False)

    @property
    def packed(self) -> bool:
        """Whether any linear runs on a packed (quantized) kernel rather than dequantized weights."""
        return any(fmt != "dense" for fmt, _ in self.weight_formats)

    @classmethod
    def from_model(cls, model, kv_itemsize: float, deterministic: bool = False) -> ModelCosts:
        """Cost a loaded model whose K/V cache stores `kv_itemsize` bytes a value (4 fp32, 2 bf16, under 2 int8
        with its scales); `deterministic`: --deterministic (prefill queries read in place too, one row each)."""
        c = model.config
        layer_bytes = layer_params = 0
        norm_bytes = model.norm.weight.nbytes
        norms = {id(model.norm)}
        formats = {getattr(model.lm_head, "format", "dense"): 1}
        sparse: dict[int, int] = {}  # max_rows → row bytes
        sparse_params: dict[int, int] = {}  # max_rows → multiply-adds per row
        sparsity = 0.0
        for layer in model.layers:
            for name, v in vars(layer).items():
                if hasattr(v, "threshold"):  # a SparseLinear: reads only its kept inputs' rows
                    sparse[v.max_rows] = sparse.get(v.max_rows, 0) + v.row_bytes * v.in_features
                    sparse_params[v.max_rows] = sparse_params.get(v.max_rows, 0) + v.in_features * v.out_features
                    sparsity = v.sparsity
                if hasattr(v, "weight_bytes"):
                    fmt = getattr(v, "format", "dense")
                    formats[fmt] = formats.get(fmt, 0) + 1
                    layer_bytes += v.weight_bytes
                    layer_params += v.in_features * v.out_features
                elif name.endswith("norm") and id(v) not in norms:  # a norm shared by reference counts once
                    norms.add(id(v))
                    norm_bytes += v.weight.nbytes
        embed = model.embed  # packed or dense: a gather reads whole stored rows
        in_place = decodes_in_place(_kv_dtype(kv_itemsize), embed.device.type)
        head_rows = model.lm_head.max_rows if hasattr(model.lm_head, "threshold") else 0
        return cls(c, layer_bytes, model.lm_head.weight_bytes, embed.row_bytes,
                   norm_bytes, round(2 * c.num_layers * c.num_kv_heads * c.head_dim * kv_itemsize),
                   layer_params, model.lm_head.in_features * model.lm_head.out_features,
                   kv_itemsize=kv_itemsize, device=embed.device.type, weight_formats=tuple(formats.items()),
                   kv_quantized=kv_itemsize < 2,
                   decodes_in_place=in_place, queries_in_place=in_place and deterministic,
                   sparsity=sparsity, sparse_rows=tuple(sorted(sparse.items())),
                   sparse_params=tuple(sorted(sparse_params.items())), lm_head_max_rows=head_rows)

    @classmethod
    def from_config(cls, c: ModelConfig, weight_bits: float = 16.0, kv_itemsize: float = 2.0,
                    sparsity: float = 0.0, embed_itemsize: int = 2, lm_head_bits: float | None = None,
                    activation_itemsize: int = 4, compute_itemsize: int = 4, device: str = "cpu") -> ModelCosts:
        """Cost a model from its config alone (no weights loaded). `weight_bits`: stored bits per linear
        weight, scales included (bf16 16, int8 per-channel ~8, int4 group-32 with bf16 scale+zero 5);
        `kv_itemsize`: bytes per cached K/V value; `sparsity`: share of FFN neurons skipped per token
        (their weight rows are neither read nor multiplied). Agrees with `from_model` for dense weights."""
        if not 0.0 <= sparsity < 1.0:
            raise ValueError(f"sparsity must be in [0, 1), got {sparsity}")
        h, L = c.hidden_size, c.num_layers
        attn = h * (c.q_size + 2 * c.kv_size) + c.q_size * h
        ffn = 3 * h * c.ffn_size * (1.0 - sparsity)
        bias = L * (c.q_size + 2 * c.kv_size) * 4 if c.qkv_bias else 0  # fp32 biases
        layer_params = round(L * (attn + ffn))
        norm = (2 * h + (2 * h + 2 * c.head_dim if c.arch == "gemma3" else 0)) * 4
        head_bits = weight_bits if lm_head_bits is None else lm_head_bits
        return cls(c, round(layer_params * weight_bits / 8) + bias, round(h * c.vocab_size * head_bits / 8),
                   h * embed_itemsize, L * norm + h * 4, round(2 * L * c.kv_size * kv_itemsize), layer_params,
                   h * c.vocab_size, activation_itemsize=activation_itemsize,
                   kv_itemsize=kv_itemsize, compute_itemsize=compute_itemsize, device=device,
                   kv_quantized=kv_itemsize < 2, decodes_in_place=decodes_in_place(_kv_dtype(kv_itemsize), device))

    @property
    def weight_bytes_per_step(self) -> int:
        """Weights a step reads from memory: all layers, lm_head, norms (embedding rows separate)."""
        return self.layer_weight_bytes + self.lm_head_bytes + self.norm_bytes

    @property
    def activation_values_per_token(self) -> int:
        """Values of the main per-layer intermediates of one token, all layers (see llama.py, gemma3.py):
        attn_norm, qkv, rope(q), rope(k), attention out, o, residual, ffn_norm, gate_up, act, act*up,
        down, residual; Gemma3 adds q/k norms and the two post norms."""
        c = self.config
        per_layer = 6 * c.hidden_size + 3 * c.q_size + 3 * c.kv_size + 4 * c.ffn_size
        if c.arch == "gemma3":
            per_layer += 2 * c.hidden_size + c.q_size + c.kv_size
        return per_layer * c.num_layers


@dataclass(slots=True)
class StepCosts:
    weight_bytes: int = 0  # linears, norms, lm_head, embedding rows: memory → core
    kv_read_bytes: int = 0  # K/V gathered from the paged cache, padding slots included
    kv_pad_bytes: int = 0  # the part of kv_read_bytes spent on padding (decodes of unequal length)
    kv_write_bytes: int = 0  # new K/V written into their cache slots
    kv_gather_bytes: int = 0  # the contiguous per-layer K/V copy: written, converted, read by attention
    kv_copy_bytes: int = 0  # copy-on-write block duplication (read + write)
    activation_bytes: int = 0  # main intermediates, each written once and read once (estimate)
    logits_bytes: int = 0  # written by lm_head, read by the sampler
    metadata_bytes: int = 0  # token ids, positions, slots, masks, rows built on the host
    h2d_bytes: int = 0  # host → device (metadata, when the model is not on the CPU)
    d2h_bytes: int = 0  # device → host (sampled token ids)
    flops: int = 0

    @property
    def dram_bytes(self) -> int:
        """Compulsory memory traffic (what cannot stay in cache): the roofline's bytes."""
        return self.weight_bytes + self.kv_read_bytes + self.kv_write_bytes + self.kv_copy_bytes

    @property
    def kv_bytes(self) -> int:
        return self.kv_read_bytes + self.kv_write_bytes

    @property
    def total_bytes(self) -> int:
        """Every byte moved, whichever tier serves it."""
        return (self.dram_bytes + self.kv_gather_bytes + self.activation_bytes + self.logits_bytes
                + self.metadata_bytes + self.h2d_bytes + self.d2h_bytes)

    def add(self, other: StepCosts) -> None:
        """Accumulate `other` into self (mutates self)."""
        for name in _FIELDS:
            setattr(self, name, getattr(self, name) + getattr(other, name))

    def as_dict(self) -> dict[str, int]:
        return {name: getattr(self, name) for name in _FIELDS}


_FIELDS = tuple(f.name for f in fields(StepCosts))

TIERS = (  # (StepCosts field, what moves where) in journey order, for reports
    ("h2d_bytes", "host → device (ids, positions, tables, masks)"),
    ("weight_bytes", "weights (memory → core)"),
    ("kv_read_bytes", "KV read (memory → core)"),
    ("kv_gather_bytes", "KV gather copy (written, read by attention)"),
    ("kv_write_bytes", "KV write (core → memory)"),
    ("kv_copy_bytes", "KV copy-on-write"),
    ("activation_bytes", "activations (estimate)"),
    ("logits_bytes", "logits (lm_head → sampler)"),
    ("metadata_bytes", "runner metadata (host)"),
    ("d2h_bytes", "device → host (token ids)"),
)


def _visible_slots(end: int, block_size: int, window: int | None) -> int:
    """Slots of the blocks a decode at position end - 1 reads in place: from the block of its first visible key
    (the window's, on a sliding layer: keys > end - 1 - window) to its own."""
    first = max(0, end - window) // block_size if window else 0
    return ((end - 1) // block_size - first + 1) * block_size


def step_costs(mc: ModelCosts, chunks: list[tuple[int, int]], num_sampled: int,
               kv_copy_tokens: int = 0, block_size: int = 1, view_slots: int = 0,
               attn_groups: list[tuple[int, list[int]]] | None = None, prompt_logit_rows: int = 0) -> StepCosts:
    """chunks: (start position, tokens computed) per scheduled sequence, as the scheduler emitted them.
    prompt_logit_rows: prompt positions whose logits gave prompt logprobs (lm_head over PROMPT_ROWS at a time).

    `attn_groups`: the attention calls the runner made, (query length, KV length of each sequence), as
    a StepRecord carries them. Without them (a step that never ran: the what-if model) they are derived
    as runner.prepare makes them (engine/attention_calls.py). Each group is padded to its
    longest block table; attention gathers whole blocks of `block_size` slots, so keys are padded to a
    block boundary (and masked, but computed). `view_slots` of them (groups of one sequence with
    consecutive blocks) are read in place, not copied."""
    c = mc.config
    window = c.sliding_window
    if attn_groups is None:
        ends = [(n, start + n) for start, n in chunks]
        attn_groups = [(ends[c[0]][0], [ends[i][1] for i in c]) for c in attention_calls(ends, block_size)]
    T = sum(n * len(ends) for n, ends in attn_groups)
    if T == 0:
        return StepCosts()
    gathered = 0  # slots gathered per layer for K (and as many for V), or read in place
    direct = 0  # decode slots kv/decode_attention.py reads in place (each sequence's own visible blocks)
    attn = 0  # Σ queries × keys computed
    meta = mask_alias = pad = 0
    sliding = sum(map(c.is_sliding, range(c.num_layers))) / c.num_layers if window else 0.0  # their share
    for n, ends in attn_groups:
        B = len(ends)
        nb = max(-(-e // block_size) for e in ends)
        L = nb * block_size
        if mc.decodes_in_place and (n == 1 or mc.queries_in_place):
            # the blocks holding keys visible to each query (at position q - 1)
            queries = [e - i for e in ends for i in range(n)]
            read = sum((1 - sliding) * _visible_slots(q, block_size, None) + sliding * _visible_slots(
                q, block_size, window) for q in queries)
            direct += read
            gathered += read
            attn += read
            pad += sum(-(-q // block_size) * block_size - q for q in queries)
        else:
            gathered += B * L
            attn += B * n * L
            if n == 1 or B > 1:
                pad += B * L - sum(ends)  # keys past a sequence's end, computed and masked
        meta += B * nb * ID_BYTES  # block table, padded to the group's longest
        local = window is not None and max(ends) - 1 >= window
        mask = B * n * L * MASK_BYTES
        if n > 1 or any(e != L for e in ends):  # some key is past its query: a causal mask
            meta += mask
            if not local:
                mask_alias += mask  # mask_local is the mask: moved twice to a device
        if local:
            meta += mask  # a separate sliding-window mask
        if len(attn_groups) > 1:
            meta += B * n * ID_BYTES  # the group's token_index
    meta += 3 * T * ID_BYTES + num_sampled * ID_BYTES  # input ids, positions, slot mapping; sample rows

    kv_tok = mc.kv_bytes_per_token
    kv_read = round(gathered * kv_tok)
    ratio = mc.compute_itemsize / mc.kv_itemsize
    gathered = round(gathered - direct)  # decodes read in place copy nothing
    # prefill chunks of an int8 cache dequantize a copy, viewed or gathered; a view is never more than was gathered
    # (a decode read in place is no view: a caller counting it would otherwise make negative bytes)
    view_slots = 0 if mc.kv_quantized else min(view_slots, gathered)
    copied = (gathered - view_slots) * kv_tok
    gather = copied  # the contiguous copy, written at the cache dtype...
    if mc.kv_itemsize != mc.compute_itemsize:  # ...read back and converted to the compute dtype...
        gather += copied + int(copied * ratio)
    gather += int(copied * ratio)  # ...and read by attention
    if mc.kv_itemsize != mc.compute_itemsize:  # a view is still converted: written, then read
        gather += 2 * int(view_slots * kv_tok * ratio)
    if mc.kv_quantized:  # the in-place scaling pass over the dequantized values: read and written
        gather += 2 * int(gathered * kv_tok * ratio)
    lm_head = mc.lm_head_bytes if num_sampled else 0
    head_rows = float(num_sampled)  # sampled rows the lm_head multiplies in full
    if 0 < num_sampled <= mc.lm_head_max_rows:  # a sparse lm_head: each sampled row reads its kept inputs' rows
        lm_head = round(mc.lm_head_bytes * num_sampled * (1 - mc.sparsity))
        head_rows = num_sampled * (1 - mc.sparsity)  # and multiplies only those
    lm_head += mc.lm_head_bytes * -(-prompt_logit_rows // PROMPT_ROWS)  # dense: more than a few rows
    layer_bytes = mc.layer_weight_bytes
    for max_rows, row_bytes in mc.sparse_rows:  # gathered GEMVs: each row reads only its kept inputs' rows
        if T <= max_rows:
            layer_bytes += round(row_bytes * (T * (1 - mc.sparsity) - 1))
    layer_macs = T * mc.layer_params
    for max_rows, params in mc.sparse_params:  # ...and multiplies only those (past max_rows: zeroed inputs too)
        if T <= max_rows:
            layer_macs -= round(T * params * mc.sparsity)
    on_device = mc.device != "cpu"
    return StepCosts(
        weight_bytes=layer_bytes + mc.norm_bytes + lm_head + T * mc.embed_row_bytes,
        kv_read_bytes=kv_read,
        kv_pad_bytes=pad * kv_tok,
        kv_write_bytes=T * kv_tok,
        kv_gather_bytes=gather,
        kv_copy_bytes=2 * kv_copy_tokens * kv_tok,
        activation_bytes=2 * T * mc.activation_values_per_token * mc.activation_itemsize,
        logits_bytes=2 * (num_sampled + prompt_logit_rows) * c.vocab_size * 4,  # fp32: lm_head → sampler
        metadata_bytes=meta,
        h2d_bytes=meta + mask_alias if on_device else 0,
        d2h_bytes=num_sampled * ID_BYTES if on_device else 0,
        flops=2 * layer_macs + round(2 * (head_rows + prompt_logit_rows) * mc.lm_head_params)
        + round(4 * attn * c.num_heads * c.head_dim * c.num_layers),  # linears; QK^T and PV
    )


def prefix_miss_cost(missed_tokens: int, kv_bytes_per_token: int, prefill_bytes: int, prefill_flops: int,
                     prefill_tokens: int) -> dict[str, float]:
    """What prompt tokens the prefix cache did not hold cost the core that computed them: their KV
    written (what a hit would have reused, or a cluster would ship instead of computing it again),
    and the bytes moved and FLOPs at that core's measured prefill averages per token."""
    per = prefill_tokens or 1
    return {"tokens": missed_tokens, "kv_bytes": missed_tokens * kv_bytes_per_token,
            "bytes_moved": missed_tokens * prefill_bytes / per, "flops": missed_tokens * prefill_flops / per}
