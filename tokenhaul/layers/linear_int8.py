"""8-bit per-channel weights on `_weight_int8pack_mm` (bf16 activations): symmetric, one scale per row."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from tokenhaul.layers.linear import Linear, Part, dequantize_part, register


@register("int8")
class Int8Linear(Linear):
    """The packed kernel for up to `max_rows` rows; more rows dequantize to bf16 for one dense GEMM."""

    max_rows: int | None = 16  # int8pack is slower than a bf16 GEMM from ~8 rows (MACHINE.md); dequant is 2 ops

    def __init__(self, weight: torch.Tensor, scales: torch.Tensor, bias: torch.Tensor | None) -> None:
        self.weight = weight  # int8 [out, in]
        self.scales = scales  # bf16 [out]
        self.scales_col = scales.view(-1, 1)  # the same storage, shaped to scale rows
        self.out_features, self.in_features = weight.shape
        self.bias = bias

    @classmethod
    def supports(cls, in_features: int, group: int | None) -> bool:
        return in_features % 16 == 0  # the kernel reads 16 inputs at a time (other widths crash in torch 2.13)

    @classmethod
    def build(cls, parts: list[Part], bias, dtype, device, group=None) -> Int8Linear:
        w = torch.cat([dequantize_part(p) for p in parts])
        scale = (w.abs().amax(dim=1) / 126.5).bfloat16().float()  # rounded up or down, |q| stays <= 127
        q = (w / torch.where(scale == 0, 1.0, scale)[:, None]).round().clamp(-127, 127).to(torch.int8)
        b = None if bias is None else bias.to(device, torch.float32)
        return cls(q.to(device), scale.to(device, torch.bfloat16), b)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        xb = x.to(torch.bfloat16)
        if self.max_rows is not None and x.shape[0] > self.max_rows:
            y = F.linear(xb, self.dequantize(torch.bfloat16))
        else:
            y = torch.ops.aten._weight_int8pack_mm(xb, self.weight, self.scales)
        return self._add_bias(y).to(x.dtype)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """[out, in] at `dtype`: reads the int8 weight once and the scales once."""
        return self.weight.to(dtype).mul_(self.scales_col)

    def tensors(self) -> list[torch.Tensor]:
        return [self.weight, self.scales] + ([] if self.bias is None else [self.bias])

    def state(self) -> dict[str, torch.Tensor]:
        return {"weight": self.weight, "scales": self.scales} | ({} if self.bias is None else {"bias": self.bias})

    @classmethod
    def from_state(cls, state, device) -> Int8Linear:
        bias = state.get("bias")
        return cls(state["weight"].to(device), state["scales"].to(device), None if bias is None else bias.to(device))
