"""`this-machine` / `this-machine-cuda`: the hardware profile of the device the engine runs on, measured.

Each figure is measured with the engine's own kernels on that device (the CPU at the current thread count,
or a CUDA GPU; timed by whatif/clock.py): read bandwidth of its memory, GEMV bandwidth and GEMM FLOP/s
per weight format (the packed kernels actually used there), the gathered-K/V copy and attention rates,
elementwise traffic, host↔device copies (a GPU; recorded, already inside the fitted overheads), and the
engine's per-step / per-layer / per-group / per-token overheads (an EngineCore over random models of 2 and
10 layers, where kernels are negligible: on a GPU, launches and Python). Cached beside the roofline
calibration, keyed by CPU model, threads and device."""

from __future__ import annotations

import dataclasses
import itertools
import os
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from tokenhaul.whatif import calibrate as cal
from tokenhaul.whatif import clock, kernels
from tokenhaul.whatif.hardware import THIS_MACHINE, THIS_MACHINE_CUDA, Hardware, from_dict
from tokenhaul.whatif.kernels import DENSE, LinearTimes, available_formats, cache_bytes, make_linear


@dataclass(frozen=True)
class Sizes:
    """How big the probes are: on a CPU or a GPU large enough that weights and K/V come from memory, not a
    cache; TINY runs every code path in a second (tests), its figures meaningless."""

    read_bytes: int = 2**29  # the read-bandwidth probe
    gemv_bytes: float = 96e6  # weights read per GEMV pass
    matrix: tuple[int, int] = (2048, 1024)  # (out, in) of the GEMV / GEMM probes
    gemm_rows: int = 256
    kv_len: int = 512  # K/V slots per sequence of the decode-attention probe (8 sequences)
    prompt: int = 256  # query tokens of the prefill-attention probe
    host_bytes: int = 2**26  # host↔device copies (a GPU)
    steps: int = 12  # decode steps per configuration of the overhead fit
    repeats: int = 3


TINY = Sizes(read_bytes=2**20, gemv_bytes=2e5, matrix=(64, 32), gemm_rows=8, kv_len=64, prompt=32,
             host_bytes=2**16, steps=2, repeats=1)


def sizes_for(device: str) -> Sizes:
    """The CPU's sizes; a GPU's: a 1 GiB read, ≥ 4 × L2 of weights per pass, 4096-row GEMMs, K/V ≫ L2."""
    if not clock.is_cuda(device):
        return Sizes()
    l2 = torch.cuda.get_device_properties(torch.device(device)).L2_cache_size
    return Sizes(read_bytes=2**30, gemv_bytes=max(96e6, 4.0 * l2), gemm_rows=4096, kv_len=16384, prompt=2048)


def profile_name(device: str) -> str:
    return THIS_MACHINE_CUDA if clock.is_cuda(device) else THIS_MACHINE


def _ram_bytes() -> float:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError):
        return 16e9


def linear_rates(fmt: str, read_bw: float, device: str = "cpu", sizes: Sizes = Sizes()) -> tuple[float, float]:
    """(GEMV bandwidth as a share of read bandwidth, GEMM FLOP/s) of the engine's linear for `fmt`."""
    out, in_ = sizes.matrix
    probe = make_linear(fmt, torch.randn(out, in_), device)
    n_mats = max(8, int(sizes.gemv_bytes // probe.weight_bytes))  # ≫ the last-level cache: GEMVs read memory
    lins = [probe] + [make_linear(fmt, torch.randn(out, in_), device) for _ in range(n_mats - 1)]
    nbytes = sum(lin.weight_bytes for lin in lins)
    x1 = kernels.activations(fmt, 1, in_, device)
    gemv = clock.best_seconds(lambda: kernels.call_each(lins, x1), device, sizes.repeats)
    xm = kernels.activations(fmt, sizes.gemm_rows, in_, device)
    few = lins[:12]  # long enough (~0.1-1 s on a CPU) that one quiet moment on a shared machine does not decide it
    gemm = clock.best_seconds(lambda: kernels.call_each(few, xm), device, sizes.repeats)
    return nbytes / gemv / read_bw, 2 * sizes.gemm_rows * in_ * out * len(few) / gemm


def attention_rates(read_bw: float, device: str = "cpu", sizes: Sizes = Sizes()) -> tuple[float, float]:
    """(gathered-K/V bytes/s, attention FLOP/s): a padded decode group over fp32 caches (bf16 and int8 decodes
    read their blocks in place, no copy to time) and a prefill group over bf16 ones, through
    layers.attention.paged_attention, bytes counted by ledger/costs.step_costs."""
    from tokenhaul.layers.attention import AttentionMetadata, AttnGroup, paged_attention
    from tokenhaul.ledger.costs import ModelCosts, step_costs
    from tokenhaul.models.config import ModelConfig

    H, Hkv, D, bs, B, L, Q = 9, 3, 64, 16, 8, sizes.kv_len, sizes.prompt
    cfg = ModelConfig("llama", H * D, 1, H, Hkv, D, 1536, 1000, 8192, 1e-5, 1e4, True)
    mc, mc32 = ModelCosts.from_config(cfg, 16, 2), ModelCosts.from_config(cfg, 16, 4)
    nb = B * L // bs + 8

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(*shape).to(device)

    kc, vc = (rand(nb, bs, Hkv, D).to(torch.bfloat16) for _ in range(2))
    table = torch.randperm(nb)[: B * L // bs].view(B, L // bs).to(device)
    slots = table[:, -1] * bs + bs - 1
    q, k, v = rand(B, H, D), rand(B, Hkv, D), rand(B, Hkv, D)
    meta = AttentionMetadata(slots, slots, [AttnGroup(B, 1, None, table, None, None)], B)
    kc32, vc32 = kc.float(), vc.float()
    t_dec = clock.best_seconds(lambda: paged_attention(q, k, v, kc32, vc32, meta, D**-0.5, False), device,
                               sizes.repeats)
    sc = step_costs(mc32, [(L - 1, 1)] * B, 0, block_size=bs)
    gather_bw = sc.kv_gather_bytes / max(t_dec - (sc.kv_read_bytes + sc.kv_write_bytes) / read_bw, t_dec / 4)
    ptable = torch.arange(Q // bs, device=device)[None]
    pos = torch.arange(Q, device=device)
    mask = (pos[None, :] <= pos[:, None])[None, None]
    pq, pk, pv = rand(Q, H, D), rand(Q, Hkv, D), rand(Q, Hkv, D)
    pmeta = AttentionMetadata(pos, pos, [AttnGroup(1, Q, None, ptable, mask, mask, 0)], Q)
    t_pre = clock.best_seconds(lambda: paged_attention(pq, pk, pv, kc, vc, pmeta, D**-0.5, False), device,
                               sizes.repeats)
    pc = step_costs(mc, [(0, Q)], 0, block_size=bs, view_slots=Q)
    attn_flops = pc.flops - 2 * Q * mc.layer_params
    return gather_bw, attn_flops / max(t_pre - pc.kv_gather_bytes / gather_bw, t_pre / 4)


def activation_bandwidth(device: str = "cpu", sizes: Sizes = Sizes()) -> float:
    """Bytes/s of a Llama layer's elementwise work (norms, rope, SiLU·up, residuals) over 256 tokens,
    bytes counted as ledger/costs.py counts activation traffic."""
    from tokenhaul.layers.norm import RMSNorm
    from tokenhaul.layers.rope import RotaryEmbedding
    from tokenhaul.ledger.costs import ModelCosts
    from tokenhaul.models.config import ModelConfig

    T, h, H, Hkv, D, f = 256, 576, 9, 3, 64, 1536
    cfg = ModelConfig("llama", h, 1, H, Hkv, D, f, 1000, 8192, 1e-5, 1e4, True)
    norm, rope = RMSNorm(torch.ones(h, device=device), 1e-5), RotaryEmbedding(D, 1024, 1e4, torch.device(device))
    hs, qkv, gu = (torch.randn(T, n).to(device) for n in (h, (H + 2 * Hkv) * D, 2 * f))
    pos = torch.arange(T, device=device)

    def layer():
        x = norm(hs)
        q, k, _ = qkv.split([H * D, Hkv * D, Hkv * D], dim=-1)
        rope(q.reshape(T, H, D), pos)
        rope(k.reshape(T, Hkv, D), pos)
        y = hs + x
        gate, up = gu.chunk(2, dim=-1)
        return norm(y) + (F.silu(gate) * up)[:, :h]

    nbytes = 2 * T * ModelCosts.from_config(cfg).activation_values_per_token * 4
    return nbytes / clock.best_seconds(layer, device, sizes.repeats)


def host_link(device: str, nbytes: int = 2**26, repeats: int = 3) -> dict[str, float]:
    """Copies between host memory and `device` as the engine makes them (pageable tensors): bytes/s each
    way, and the seconds the host waits for 8 bytes back (a step's sampled token). On the CPU a memcpy."""
    host = torch.ones(nbytes // 4)
    dev = host.to(device)
    one = torch.ones(1, dtype=torch.long, device=device)
    return {"to_device": nbytes / clock.best_seconds(lambda: host.to(device, copy=True), device, repeats),
            "to_host": nbytes / clock.best_seconds(lambda: dev.to("cpu", copy=True), device, repeats),
            "latency_s": clock.best_seconds(one.tolist, "cpu", repeats)}  # it blocks: the host's wall clock


def _linear_seconds(model, rows: int, sampled: int, memo: dict, device: str) -> float:
    """Seconds of a step's linear calls in a Llama model: each layer's 4 at `rows`, the lm_head at `sampled`."""
    layer = model.layers[0]
    total = 0.0
    for n, lins, times in ((rows, (layer.qkv, layer.o, layer.gate_up, layer.down), len(model.layers)),
                           (sampled, (model.lm_head,), 1)):
        key = (n, lins)
        if key not in memo:
            xs = [torch.randn(n, lin.in_features, device=device) for lin in lins]
            memo[key] = clock.best_seconds(lambda lins=lins, xs=xs: [lin(x) for _ in range(10)
                                                                     for lin, x in zip(lins, xs)], device) / 10
        total += times * memo[key]
    return total


def engine_overheads(device: str = "cpu", steps: int = 12) -> dict[str, float]:
    """Per-step, per-layer, per-attention-call-per-layer (more for a prefill or a gathered call), per-token
    seconds of the engine itself, fitted on step times of random fp32 models of 2 and 10 layers (hidden
    64), less their linear calls (4 per layer and the lm_head, timed alone at the step's rows): those are
    timed per real shape (whatif/kernels.py). Best times, like every figure here: on a shared machine the
    least-disturbed run is the reproducible one. Steps are timed on the host's clock: the core synchronizes
    a GPU before it samples, so a step's time is what its caller waits."""
    from tokenhaul.config import EngineConfig
    from tokenhaul.engine.attention_calls import attention_calls
    from tokenhaul.engine.core import EngineCore
    from tokenhaul.models.config import ModelConfig
    from tokenhaul.models.llama import LlamaModel
    from tokenhaul.sampling_params import SamplingParams

    best: dict[tuple[int, int, int, int], float] = {}
    ids = itertools.count()
    g = torch.Generator().manual_seed(0)
    for layers in (2, 10):
        cfg = ModelConfig("llama", 64, layers, 4, 2, 16, 96, 97, 1024, 1e-5, 1e4, True)
        w = {"token_embd.weight": torch.randn(97, 64, generator=g), "output_norm.weight": torch.ones(64)}
        for i in range(layers):
            p = f"blk.{i}."
            for name, shape in (("attn_q", (64, 64)), ("attn_k", (32, 64)), ("attn_v", (32, 64)),
                                ("attn_output", (64, 64)), ("ffn_gate", (96, 64)), ("ffn_up", (96, 64)),
                                ("ffn_down", (64, 96))):
                w[p + name + ".weight"] = torch.randn(*shape, generator=g)
            w[p + "attn_norm.weight"] = w[p + "ffn_norm.weight"] = torch.ones(64)
        model = LlamaModel(cfg, {k: v.to(device) for k, v in w.items()}, 1024)
        core = EngineCore(EngineConfig(model="tiny", dtype="fp32", device=device, num_kv_blocks=512, block_size=16),
                          model)
        memo: dict = {}
        for batch, prompt, step in ((1, 4, 0), (1, 8, 0), (16, 8, 0), (4, 48, 4), (4, 48, 4), (2, 8, 992)):
            params = SamplingParams(max_tokens=steps + 1, temperature=0, ignore_eos=True)
            lengths = [prompt + step * r for r in range(batch)]  # unequal prompts: one attention call each
            # (8 and 1000 tokens: their decodes are split into two calls)
            for r, n in enumerate(lengths):
                core.add_request(f"c{next(ids)}", [(r * 7 + j) % 90 + 1 for j in range(n)], params)
            t = time.perf_counter()
            core.step()  # the prefill
            pre = time.perf_counter() - t
            dec = []
            while core.has_unfinished():
                t = time.perf_counter()
                core.step()
                dec.append(time.perf_counter() - t)
            if prompt == 4:  # the first run warms up
                continue
            rows = [([(n, n) for n in lengths], pre)] if max(lengths) < 100 else []  # long prompts: attention-bound
            for chunks, t in rows + [([(1, n + 1) for n in lengths], min(dec))]:
                t -= _linear_seconds(model, sum(q for q, _ in chunks), batch, memo, device)
                calls = attention_calls(chunks, 16)
                gathered = sum(len(c) > 1 for c in calls)
                prefill_calls = sum(chunks[c[0]][0] > 1 for c in calls)
                row = (1, layers, layers * max(0, len(calls) - prefill_calls - 1), layers * bool(prefill_calls),
                       layers * prefill_calls, layers * gathered, sum(q for q, _ in chunks))
                best[row] = min(t, best.get(row, t))  # repeated configurations: the best time
    a, t = np.array(list(best), dtype=float), np.array(list(best.values()))
    sol, *_ = np.linalg.lstsq(a / t[:, None], np.ones_like(t), rcond=None)  # relative: short steps weigh as much
    # group: one decode call more; prefill_step: a step with prompt chunks; prefill_call: each such call
    step_s, layer_s, group_s, prefill_step_s, prefill_s, gather_s, token_s = (float(x) for x in sol)
    return {"step_s": max(0.0, step_s), "layer_s": max(0.0, layer_s), "group_s": max(0.0, group_s),
            "prefill_layer_s": max(0.0, prefill_step_s), "prefill_call_s": max(0.0, prefill_s),
            "gather_s": max(0.0, gather_s), "token_s": max(0.0, token_s)}


def _tiers(device: str, read_bw: float) -> list[dict]:
    """Caches (they hold nothing) and the memory weights and K/V live in, with its capacity."""
    if clock.is_cuda(device):
        props = torch.cuda.get_device_properties(torch.device(device))
        return [{"name": "L2", "capacity": float(props.L2_cache_size), "bandwidth": 0.0, "holds": False},
                {"name": "VRAM", "capacity": float(props.total_memory), "bandwidth": read_bw}]
    return [{"name": "L2", "capacity": cache_bytes(2), "bandwidth": 0.0, "holds": False},
            {"name": "L3", "capacity": cache_bytes(3), "bandwidth": 0.0, "holds": False},
            {"name": "DRAM", "capacity": _ram_bytes(), "bandwidth": read_bw}]


def measure_profile(device: str = "cpu", sizes: Sizes | None = None) -> dict:
    """Measure every figure of the profile of `device` (about half a minute on 2 CPU cores)."""
    sizes = sizes or sizes_for(device)
    t0 = time.perf_counter()
    read_bw = cal.measure_bandwidth(device, nbytes=sizes.read_bytes)
    flops, kernel_bw, weight_only = {}, {}, {}
    for fmt in available_formats():
        kernel_bw[fmt], rate = linear_rates(fmt, read_bw, device, sizes)
        (flops if fmt in DENSE else weight_only)[fmt] = rate
    gather_bw, flops["attention"] = attention_rates(read_bw, device, sizes)
    description = f"{cal.machine_key(device)} (calibrated)"
    entry = {}
    if clock.is_cuda(device):
        entry["host_link"] = link = host_link(device, sizes.host_bytes, sizes.repeats)
        description += (f"; host↔device {link['to_device'] / 1e9:.1f} / {link['to_host'] / 1e9:.1f} GB/s, "
                        f"{link['latency_s'] * 1e6:.0f} µs back (inside the fitted overheads)")
    return entry | {
        "name": profile_name(device), "description": description, "device": device, "chips": 1,
        "paged_kernel": "gather", "flops": flops, "weight_only_flops": weight_only, "kernel_bandwidth": kernel_bw,
        "gather_bandwidth": gather_bw, "activation_bandwidth": activation_bandwidth(device, sizes),
        "overhead": engine_overheads(device, sizes.steps), "tier": _tiers(device, read_bw),
        "measure_seconds": time.perf_counter() - t0,
    }


def this_machine(remeasure: bool = False, root: Path | None = None, device: str = "cpu") -> Hardware:
    """The calibrated profile of `device` here (`this-machine`, or `this-machine-cuda` for a GPU): from the
    cache file, else measured now (and stored). TokenhaulError where the device cannot be measured."""
    clock.check_device(device)
    key = cal.machine_key(device) + " | whatif-profile"
    entry = None if remeasure else cal.load_entry(key, root)
    # measured again when a kernel was registered after the cached entry was made
    if entry is None or not set(available_formats()) <= set(entry["flops"]) | set(entry.get("weight_only_flops", {})):
        entry = measure_profile(device)
        cal.store_entry(key, entry, root)
    hw = from_dict(entry, profile_name(device), str(cal.calibration_path(root)))
    return dataclasses.replace(hw, linear_times=LinearTimes(available_formats(), root, remeasure, device))
