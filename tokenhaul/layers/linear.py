"""Linear layers behind one interface and a registry of storage formats, so the models never know how a
weight is stored. A new format is a new file: subclass `Linear`, decorate it with `@register("name")`,
and import the file in `layers/quantization.py`."""

from __future__ import annotations

from typing import ClassVar

import torch

from tokenhaul.layers.gguf_weight import GGUFWeight

Part = torch.Tensor | GGUFWeight  # one weight [out, in] as given: a float tensor or raw GGUF blocks

FORMATS: dict[str, type[Linear]] = {}


def register(name: str):
    """Class decorator: make a Linear subclass the kernel for storage format `name`."""

    def deco(cls: type[Linear]) -> type[Linear]:
        cls.format = name
        FORMATS[name] = cls
        return cls

    return deco


class Linear:
    """y = x @ W^T (+ b), returned in x's dtype (bf16 in, bf16 out: no round trip). `tensors()` is what one
    pass reads from memory (the ledger's count); `state()` / `from_state()` round-trip the converted weights
    through the on-disk cache."""

    format: ClassVar[str]
    in_features: int
    out_features: int
    bias: torch.Tensor | None = None

    @classmethod
    def supports(cls, in_features: int, group: int | None) -> bool:
        """Whether the kernel handles this width (the factory falls back to dense when not)."""
        return True

    @classmethod
    def build(cls, parts: list[Part], bias: torch.Tensor | None, dtype: torch.dtype,
              device: torch.device, group: int | None) -> Linear:
        """Convert the parts (stacked along out) into this format."""
        raise NotImplementedError

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def pin_one_kernel(self) -> None:
        """Keep one kernel at every row count, so a row's numbers do not depend on its batch (--deterministic)."""
        raise NotImplementedError

    def tensors(self) -> list[torch.Tensor]:
        raise NotImplementedError

    def state(self) -> dict[str, torch.Tensor]:
        raise NotImplementedError

    @classmethod
    def from_state(cls, state: dict[str, torch.Tensor], device: torch.device) -> Linear:
        raise NotImplementedError

    @property
    def weight_bytes(self) -> int:
        return sum(t.nbytes for t in self.tensors())

    def _add_bias(self, y: torch.Tensor) -> torch.Tensor:
        """Adds the (fp32) bias in place: y keeps its dtype, no extra tensor."""
        return y if self.bias is None else y.add_(self.bias)


def low_precision_gemm_is_fast(device: torch.device) -> bool:
    """Whether many-row bf16 and int8 GEMMs run at GEMM speed here: on CUDA, and on CPUs with oneDNN's bf16 path
    (AVX-512). With AVX2 only, torch 2.13 runs both as fallback loops (2 cores of a Zen 3 host: bf16 `F.linear`
    14 GFLOP/s, `x @ w` 0.7, fp32 88; `_int_mm` 995 ms for SmolLM2's 120 layer GEMMs at 8 rows, int8pack 15 at
    4; bench/RESULTS.md "AVX2 hosts"), so many rows compute in fp32."""
    return device.type != "cpu" or bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())


FP32_GEMM_ROWS = 32  # from here a bf16 weight is widened to fp32 for the GEMM where bf16 GEMMs are slow (2 cores,
# SmolLM2 layers: 0.7x at 32 rows, 0.45x at 64; at 16 rows the widening cost more than it saved)


def make_linear(weight: torch.Tensor, bias: torch.Tensor | None = None, quantization: str = "none") -> Linear:
    """One linear from one float weight (benchmarks, the what-if calibration); models use a LinearFactory."""
    from tokenhaul.layers.quantization import LinearFactory, QuantSpec

    return LinearFactory(QuantSpec.parse(quantization), weight.dtype, weight.device).linear("w", [weight], bias)


def dequantize_part(p: Part) -> torch.Tensor:
    """One part as an fp32 [out, in] tensor (exact for GGUF blocks: gguf's own dequantization)."""
    return p.dequantize() if isinstance(p, GGUFWeight) else p.float()

