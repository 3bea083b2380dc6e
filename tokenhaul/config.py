"""EngineConfig: one frozen, validated config passed down; run-time facts live in RuntimeInfo."""

from __future__ import annotations

import os
from dataclasses import dataclass, field

import torch

from tokenhaul.errors import TokenhaulError
from tokenhaul.layers.quantization import QuantSpec

DTYPES = {"fp32": torch.float32, "float32": torch.float32, "bf16": torch.bfloat16, "bfloat16": torch.bfloat16}
DEFAULT_MAX_MODEL_LEN = 8192  # capped at a shorter model's context; a length set above the model's is an error
KV_DTYPES = {"auto": None, "fp32": torch.float32, "bf16": torch.bfloat16, "int8": torch.int8}  # auto: as --dtype


@dataclass(frozen=True)
class EngineConfig:
    model: str = "smollm2-135m"
    device: str = "cpu"
    dtype: str = "bf16"  # measured (bench/generate.py): bf16 decodes 1.4-1.8x, prefills 2.4-3.3x faster than fp32
    block_size: int = 16
    kv_memory_gib: float = 1.0
    num_kv_blocks: int | None = None  # overrides kv_memory_gib
    max_num_batched_tokens: int = 512
    max_num_seqs: int = 64
    max_model_len: int = DEFAULT_MAX_MODEL_LEN
    enable_prefix_caching: bool = True
    threads: int | None = None
    draft_model: str | None = None  # alias or GGUF path of a draft model sharing the target's vocabulary
    draft_quantization: str | None = None  # the draft's own --quantization; None: int4 under bf16 (a 0.5B draft
    # step then costs ~0.16 of a dense 1.5B step instead of ~0.33, bench/RESULTS.md), else as `quantization`
    speculative_max_batch: int = 8  # above this many running requests nothing is drafted (bench/decoding.py)
    kv_dtype: str = "auto"  # auto (the compute dtype) | fp32 | bf16 | int8 (per-token-per-head scales, kv/int8.py)
    sparsity: float = 0.0  # share of projection inputs zeroed (TEAL, layers/linear_sparse.py); 0 = off
    itl_target_ms: float = 0.0  # > 0: prefill chunks sized so each step's predicted time stays under it; 0 = off
    quantization: str = "auto"  # auto | none | int8 | int4[:32|64|128]; see layers/quantization.py
    deterministic: bool = False  # batch-invariant attention: same tokens whatever is batched or cached (costs
    # prefill time, bench/determinism.py)
    compile: str = field(default_factory=lambda: os.environ.get("TOKENHAUL_COMPILE", "auto"))  # batch-1 decode as
    # one compiled graph (engine/compiled_decode.py): auto (bf16 on CPU, once compiled into inductor's cache) | on | off

    def __post_init__(self) -> None:
        if self.dtype not in DTYPES:
            raise TokenhaulError(f"unknown dtype '{self.dtype}' (choose from {', '.join(DTYPES)})")
        if not (isinstance(self.sparsity, (int, float)) and 0.0 <= self.sparsity <= 0.9):
            raise TokenhaulError(f"--sparsity must be 0 (off) or a share of inputs in (0, 0.9] such as 0.25, 0.4, "
                                 f"0.5; got {self.sparsity}")
        if self.kv_dtype not in KV_DTYPES:
            raise TokenhaulError(f"unknown --kv-dtype '{self.kv_dtype}' (choose from {', '.join(KV_DTYPES)})")
        if self.device.startswith("cuda") and not torch.cuda.is_available():
            raise TokenhaulError("--device cuda requested but CUDA is not available")
        QuantSpec.parse(self.quantization)  # raises TokenhaulError on a bad value
        try:
            QuantSpec.parse(self.draft_quant)
        except TokenhaulError as e:
            raise TokenhaulError(f"--draft-quantization: {e}") from None
        sizes = {"block_size": self.block_size, "max_num_batched_tokens": self.max_num_batched_tokens,
                 "max_num_seqs": self.max_num_seqs, "max_model_len": self.max_model_len,
                 "kv_memory_gib": self.kv_memory_gib, "num_kv_blocks": self.num_kv_blocks, "threads": self.threads}
        for name, value in sizes.items():  # None: unset (kv_memory_gib decides, torch's thread count)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int | float)
                                      or not 0 < value < float("inf")):  # NaN too
                raise TokenhaulError(f"{name} must be a positive number, got {value!r}")
        if self.deterministic and self.sparsity:
            raise TokenhaulError("--deterministic cannot be combined with --sparsity (its kernel changes with the "
                                 "number of rows)")
        if self.compile not in ("auto", "on", "off"):
            raise TokenhaulError(f"unknown --compile '{self.compile}' (choose from auto, on, off)")
        if self.compile == "on" and self.compile_blocker:
            raise TokenhaulError(f"--compile on: {self.compile_blocker}")
        if self.speculative_max_batch < 0:
            raise TokenhaulError("speculative_max_batch must be >= 0")
        if not 0 <= self.itl_target_ms < float("inf"):
            raise TokenhaulError(f"--itl-target-ms must be a finite number >= 0 (0 = off), got {self.itl_target_ms}")

    @property
    def compile_blocker(self) -> str | None:
        """Why the compiled decode step cannot run under this config (None: it can)."""
        import shutil

        if not self.device.startswith("cpu"):
            return "the compiled decode step runs on the CPU only"
        if self.deterministic:
            return "cannot be combined with --deterministic (the compiled step's kernels differ from the eager ones)"
        if not any(shutil.which(c) for c in ("g++", "c++", "clang++")):
            return "needs a C++ compiler on PATH (g++)"
        return None

    @property
    def compiled_decode(self) -> bool:
        """Whether batch-1 decode runs as one compiled graph: `on`, or `auto` with bf16 (fp32 is the exact path)."""
        if self.compile == "off" or self.compile_blocker:
            return False
        return self.compile == "on" or self.torch_dtype == torch.bfloat16

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]

    @property
    def draft_quant(self) -> str:
        """The draft model's quantization: packed int4 under bf16 unless `draft_quantization` says otherwise."""
        if self.draft_quantization is not None:
            return self.draft_quantization
        return "int4" if self.torch_dtype == torch.bfloat16 else self.quantization

    @property
    def kv_torch_dtype(self) -> torch.dtype:
        """The KV cache's storage dtype (torch.int8: int8 values with fp32 scales)."""
        return KV_DTYPES[self.kv_dtype] or self.torch_dtype


def engine_config(model: str, **kwargs) -> EngineConfig:
    """EngineConfig from LLM(...)'s keywords: ours, or vLLM's names for the same things (enforce_eager,
    kv_cache_dtype, dtype="auto", tensor_parallel_size=1, trust_remote_code) so a ported script runs; any other
    name is a one-line error listing ours."""
    kw = dict(kwargs)
    if kw.pop("enforce_eager", False):
        kw.setdefault("compile", "off")
    if "kv_cache_dtype" in kw:
        kw.setdefault("kv_dtype", kw.pop("kv_cache_dtype"))
    if kw.get("dtype") == "auto":
        del kw["dtype"]
    if kw.pop("tensor_parallel_size", 1) != 1:
        raise TokenhaulError("tensor_parallel_size: one engine runs on one device here; for more throughput run "
                             "replicas (tokenhaul serve --replicas N)")
    kw.pop("trust_remote_code", None)  # GGUF files hold no code to trust
    if "max_model_len" in kw and kw["max_model_len"] is None:  # vLLM's default: the model's (ours, capped)
        del kw["max_model_len"]
    ours = {f for f in EngineConfig.__dataclass_fields__ if f != "model"}
    if unknown := sorted(set(kw) - ours):
        raise TokenhaulError(f"unknown engine argument(s) {', '.join(unknown)}; choose from {', '.join(sorted(ours))}")
    return EngineConfig(model=model, **kw)
