"""Linear layers behind one interface, so quantized kernels slot in without touching the models."""

from __future__ import annotations

import torch


class Linear:
    """y = x @ W^T (+ b). Subclasses choose the storage; `weight_bytes` is what one pass reads."""

    in_features: int
    out_features: int

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    @property
    def weight_bytes(self) -> int:
        raise NotImplementedError


class DenseLinear(Linear):
    """Unquantized weights. fp32 is stored transposed [in, out]: `x @ Wt` streams faster on CPU GEMV
    (10-11 GB/s vs 6-7.5 for the [out, in] layout, see MACHINE.md); bf16 keeps [out, in] and returns fp32."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None) -> None:
        self.out_features, self.in_features = weight.shape
        self.transposed = weight.dtype == torch.float32 and weight.device.type == "cpu"
        self.weight = weight.t().contiguous() if self.transposed else weight.contiguous()
        self.bias = bias

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        x = x.to(self.weight.dtype)
        if self.transposed:
            y = x @ self.weight
            return y if self.bias is None else y + self.bias
        y = torch.nn.functional.linear(x, self.weight).float()
        return y if self.bias is None else y + self.bias  # bias stays fp32

    @property
    def weight_bytes(self) -> int:
        b = 0 if self.bias is None else self.bias.nbytes
        return self.weight.nbytes + b


def make_linear(weight: torch.Tensor, bias: torch.Tensor | None = None) -> Linear:
    """The one place a model asks for a linear layer; quantization variants register here later."""
    return DenseLinear(weight, bias)


def fuse_rows(*weights: torch.Tensor) -> torch.Tensor:
    """Stack [out_i, in] weights into one [sum(out_i), in] so one GEMV reads them in a single pass."""
    return torch.cat(weights, dim=0)
