"""Int4 packed weights × a few activation rows: `torch.ops.tokenhaul_int4.gemv`, the few-row path of `Int4Linear`
(batch-1 decode), reading the CPU int4pack layout as it is stored (blocks of 64 or 32 rows: `linear_int4.block_n`).

A small C++ kernel (int4_gemv.cpp, built on first use: tokenhaul/native.py), registered as a torch op with a fake
implementation so the compiled decode step can call it. Per group the codes are summed against the activations
and the group's scale and zero applied to the sum. bf16 activations of 1-2 rows: quantized to 8 bits per 16
inputs and multiplied as bytes (llama.cpp's way: `vpdpbusd` with AVX-512 VNNI, else `vpmaddubsw`). Of more rows:
with AVX-512 VNNI the same 8-bit path in tiles of 8 rows (each row's result as if it were alone); with AVX2
(32-row blocks) the same 8-bit x against panels of codes laid out once per block for all the rows, in 3-row ×
16-output register tiles; else with AVX-512 BF16 bf16 dot products of the codes (exact as bf16) with the
activations. fp32 activations and the rest: AVX2 FMAs on the codes as fp32.
Without a C++ compiler `Int4Linear` keeps `_weight_int4pack_mm_for_cpu` (one stderr line says so)."""

from __future__ import annotations

from pathlib import Path

import torch

from tokenhaul import native

SOURCE = Path(__file__).with_name("int4_gemv.cpp")
QBLOCK = 16  # inputs per activation scale on the 8-bit path (int4_gemv.cpp)
AVX2_ROWS = 4096  # the GEMV's reach on AVX2 hosts: beyond any step's rows at default settings (2048 tokens)
SHIM = ("AOTITorchError aoti_torch_cpu_gemv(AtenTensorHandle x, AtenTensorHandle weight, "  # the op as a C function
        "AtenTensorHandle scales_zeros, int64_t group, int64_t block, AtenTensorHandle* out)")  # (native.c_shims)


def outputs(scales_zeros: torch.Tensor) -> int:
    """N of scales_zeros in torch's order [K / group, N, 2] or in unit order [N / 64, K / group, 64, 2]."""
    return scales_zeros.shape[1] if scales_zeros.dim() == 3 else scales_zeros.shape[0] * 64


def _fake(x: torch.Tensor, weight: torch.Tensor, scales_zeros: torch.Tensor, group: int, block: int) -> torch.Tensor:
    return x.new_empty(x.shape[0], outputs(scales_zeros))


def _avx512_with(*features: str) -> bool:
    """Whether this CPU runs torch's AVX-512 kernels (64-row int4 blocks) and has these /proc/cpuinfo flags besides
    avx512vbmi / bw / vl (which every AVX-512 path of int4_gemv.cpp also needs)."""
    if torch.backends.cpu.get_cpu_capability() != "AVX512":
        return False
    try:
        flags = next((line for line in Path("/proc/cpuinfo").read_text().splitlines() if line.startswith("flags")), "")
    except OSError:
        flags = ""
    return {*features, "avx512vbmi", "avx512bw", "avx512vl"} <= set(flags.split())


def eight_bit_activations(rows: int, group: int, block: int) -> bool:
    """Whether int4_gemv.cpp quantizes bf16 activations of `rows` rows to 8 bits per QBLOCK inputs against weights
    in `block`-row blocks: one or two rows with AVX2 or AVX-512; more with groups of 32, 64 or 128 and 32-row blocks
    (AVX2 hosts' layout: a row's result is the same in any batch of 3 or more rows) or 64-row blocks and AVX-512
    VNNI (a row's result does not depend on the batch). fp32 activations never are."""
    avx2 = torch.backends.cpu.get_cpu_capability() in ("AVX2", "AVX512")  # the kernel built with AVX2 (native.py)
    if rows <= 2 or not avx2 or group not in (32, 64, 128):
        return rows <= 2 and avx2
    return block == 32 or _avx512_with("avx512_vnni")


def invariant_from(group: int, block: int) -> int | None:
    """The fewest rows from which a bf16 row's result does not depend on the other rows of its call (at one thread
    count): 1 with AVX-512 VNNI's 64-row blocks (8-bit x at every row count, tiles as if each row were alone), 3
    with AVX2's 32-row blocks (its panels; 1-2 rows sum otherwise); None where 3 or more rows take the bf16 or
    fp32 sums."""
    if not eight_bit_activations(3, group, block):
        return None
    return 1 if block == 64 else 3


def quantize_activations(x: torch.Tensor) -> torch.Tensor:
    """The values the 8-bit paths multiply by: x [M, K] per QBLOCK inputs rounded to d · int8, d = max|x| / 127."""
    xb = x.float().view(x.shape[0], -1, QBLOCK)
    amax = xb.abs().amax(-1, keepdim=True)
    inv = torch.where(amax > 0, torch.full_like(amax, 127.0).div(amax), 0)  # true division (127 / t: reciprocal)
    q = torch.round(xb * inv)  # as the kernel rounds: x · (127 / max), to even
    return (q * (amax / 127)).view_as(x)


def rows() -> int:
    """Up to how many rows the GEMV runs (bench/linear_kernels.py --only gemv, bench/RESULTS.md "int4 GEMV",
    "Speed run 4" and "int4 and int8 GEMVs on AVX2"). With AVX-512 BF16 it beats int4pack at every row count
    (1.2-1.3x at 1-4 rows, 1.5-1.7x at 8-128) and the dequantize + bf16 GEMM path up to ~120 rows. With AVX2
    (torch's int4pack and bf16 GEMMs have no fast path there) it beats int4pack at every row count (1.2-2.2x, one
    layer of SmolLM2 / Qwen2.5-0.5B), and from 3 rows its 8-bit panels beat dequantize + fp32 GEMM too (~1.5x at
    512 rows): it takes every row count a step sends (bench/RESULTS.md "int4 on AVX2: 8-bit panels from 3 rows").
    On AVX-512 hosts without BF16 (torch's AVX-512 int4pack) it was measured faster only at 1 row."""
    if _avx512_with("avx512_bf16"):
        return 112
    return AVX2_ROWS if torch.backends.cpu.get_cpu_capability() == "AVX2" else 1


def available() -> bool:
    """Build (once per machine, tokenhaul/native.py) and load the kernel; False, with one stderr line, if not."""
    return native.load(SOURCE, "few-row int4 linears run _weight_int4pack_mm_for_cpu instead (slower)",
                       {"tokenhaul_int4::gemv": _fake}, parallel=True, shims={"tokenhaul_int4::gemv": SHIM})
