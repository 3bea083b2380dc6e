"""`--quantization auto|none|int8|int4[:GROUP]` and the factory every model asks for its linears.

auto keeps the file's bit width where a kernel exists (AUTO below), `none` dequantizes to the compute
dtype, int8 / int4:G requantize every linear. Packed kernels run bf16 activations; `--dtype fp32`
with auto is the exact path (everything dequantized)."""

from __future__ import annotations

import sys
from dataclasses import dataclass

import torch
from gguf import GGMLQuantizationType as Q

from tokenhaul.errors import TokenhaulError
from tokenhaul.layers import linear_dense, linear_int4, linear_int8  # noqa: F401 - register the formats
from tokenhaul.layers.embedding import Embedding
from tokenhaul.layers.gguf_weight import GGUFWeight
from tokenhaul.layers.linear import FORMATS, Linear, Part

INT4_GROUPS = (32, 64, 128)
# GGUF type → (format, group) under auto. Q4 types map exactly; wider types go to the nearest kernel.
AUTO: dict[Q, tuple[str, int | None]] = {
    Q.F32: ("dense", None), Q.F16: ("dense", None), Q.BF16: ("dense", None),
    Q.Q4_0: ("int4", 32), Q.Q4_1: ("int4", 32), Q.Q4_K: ("int4", 32),
    Q.Q5_0: ("int4", 32), Q.Q5_1: ("int4", 32), Q.Q5_K: ("int4", 32),
    Q.Q6_K: ("int8", None), Q.Q8_0: ("int8", None),
}
_DTYPE_NAMES = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}
_WIDTH = {"int4": 0, "int8": 1, "dense": 2}


def dtype_name(dtype: torch.dtype) -> str:
    """A dtype as --dtype spells it (bf16, fp16, fp32)."""
    return _DTYPE_NAMES.get(dtype, str(dtype).removeprefix("torch."))


@dataclass(frozen=True)
class QuantSpec:
    mode: str = "auto"  # auto | none | int8 | int4
    group: int | None = None  # int4 only

    @classmethod
    def parse(cls, text: str) -> QuantSpec:
        mode, sep, group = text.partition(":")
        if mode in ("auto", "none", "int8") and sep:
            raise TokenhaulError(f"--quantization '{text}': {mode} takes no group")
        if mode in ("auto", "none", "int8"):
            return cls(mode)
        if mode == "int4":
            if sep and not group:
                raise TokenhaulError(f"--quantization '{text}': no group after ':' (int4:32, int4:64 or int4:128; "
                                     "int4 alone is int4:32)")
            if not sep:
                return cls("int4", 32)
            if group.isdigit() and int(group) in INT4_GROUPS:
                return cls("int4", int(group))
            raise TokenhaulError(f"--quantization int4:{group}: group must be one of "
                                 f"{', '.join(map(str, INT4_GROUPS))}")
        raise TokenhaulError(f"unknown quantization '{text}' (choose auto, none, int8, int4[:32|64|128])")

    def __str__(self) -> str:
        return self.mode if self.group is None else f"{self.mode}:{self.group}"


class LinearFactory:
    """Builds every linear (fused parts stack along out) and the embedding for one model load.
    `cache` maps a linear's name to its converted state (see models/weight_cache.py)."""

    def __init__(self, spec: QuantSpec = QuantSpec("none"), dtype: torch.dtype = torch.float32,
                 device: str | torch.device = "cpu", cache: dict[str, tuple[str, dict]] | None = None,
                 batch_invariant: bool = False) -> None:
        self.spec = spec
        self.batch_invariant = batch_invariant  # one kernel for every row count (each is row-invariant alone)
        self.dtype = dtype
        self.device = torch.device(device)
        self.exact = spec.mode == "none" or (spec.mode == "auto" and dtype == torch.float32)
        self.cache = cache if cache is not None else {}
        self.built: dict[str, Linear] = {}  # non-dense linears converted in this load (to save)
        self.made: list[Linear | Embedding] = []  # everything made, in order (layers/weight_block.py)
        self._warned: set[str] = set()
        self._fallbacks: list[int] = []  # input widths of linears asked for a format its kernel cannot take
        self._no_layout = 0  # linears asked for int4 on a CPU build without torch's int4 layout
        self._linears = 0

    @classmethod
    def for_tensors(cls, w: dict[str, Part]) -> LinearFactory:
        """Float tensors built in memory (tests): dense, at their own dtype and device."""
        embed = w["token_embd.weight"]
        return cls(QuantSpec("none"), embed.dtype, embed.device)

    def choose(self, parts: list[Part]) -> tuple[str, int | None]:
        if self.exact:
            return "dense", None
        if self.spec.mode != "auto":
            return self.spec.mode, self.spec.group
        picks = [self._auto(p) for p in parts]
        return max(picks, key=lambda f: _WIDTH[f[0]])

    def _auto(self, p: Part) -> tuple[str, int | None]:
        if not isinstance(p, GGUFWeight):
            return "dense", None
        if p.qtype not in AUTO and p.type_name not in self._warned:
            self._warned.add(p.type_name)
            print(f"tokenhaul: no packed kernel for GGUF type {p.type_name}; dequantized to "
                  f"{dtype_name(self.dtype)}", file=sys.stderr)
        return AUTO.get(p.qtype, ("dense", None))

    def linear(self, name: str, parts: list[Part], bias: torch.Tensor | None = None) -> Linear:
        fmt, group = self.choose(parts)
        self._linears += 1
        if not FORMATS[fmt].supports(parts[0].shape[1], group):
            if fmt == "int4" and linear_int4.block_n() is None:  # asked for, or auto's pick for GGUF 4-bit blocks
                self._no_layout += 1
            elif self.spec.mode == fmt:
                self._fallbacks.append(parts[0].shape[1])
            fmt, group = "dense", None
        if fmt != "dense" and name in self.cache and self.cache[name][0] == fmt:
            lin = FORMATS[fmt].from_state(self.cache[name][1], self.device)
        else:
            lin = FORMATS[fmt].build(parts, bias, self.dtype, self.device, group)
            if fmt != "dense":
                self.built[name] = lin
        if self.batch_invariant:  # one kernel at every row count: a row's numbers must not depend on the batch
            lin.pin_one_kernel()
        self.made.append(lin)
        return lin

    def say_fallbacks(self) -> None:
        """One stderr line once the model is built: how many linears asked for --quantization int4/int8 (or given
        int4 by auto) stayed dense, and why (the kernel cannot take their input width, or this CPU has no int4
        layout: ARM and scalar torch builds)."""
        if not self._fallbacks and not self._no_layout:
            return
        spec, group = self.spec, self.spec.group
        if self._no_layout:
            kept, why = self._no_layout, "torch's CPU int4 layout needs AVX2 or AVX-512; this build has neither"
        else:
            groups = f" for groups of {group}" if group else ""
            kept, why = len(self._fallbacks), (f"no {spec.mode} kernel{groups} at input width "
                                              f"{', '.join(map(str, sorted(set(self._fallbacks))))}")
        print(f"tokenhaul: --quantization {spec}: {kept} of {self._linears} linears kept dense "
              f"{dtype_name(self.dtype)} ({why})", file=sys.stderr)

    def embedding(self, table: Part) -> Embedding:
        if isinstance(table, GGUFWeight) and not self.exact:
            embedding = Embedding(table, self.device, self.dtype)
        else:
            embedding = Embedding((table.dequantize() if isinstance(table, GGUFWeight) else table).to(self.dtype),
                                  self.device, self.dtype)
        self.made.append(embedding)
        return embedding
