"""A requested packed format that some linears cannot take (their input width) is said, once per load
(models/registry.py calls say_fallbacks once the model is built)."""

from __future__ import annotations

import torch
from tiny_models import tiny_model

from tokenhaul.layers.quantization import LinearFactory, QuantSpec


def _load(spec: str, capsys, **kw) -> str:
    make = LinearFactory(QuantSpec.parse(spec), torch.bfloat16)
    tiny_model(dtype=torch.bfloat16, make=make, **kw)
    make.say_fallbacks()
    return capsys.readouterr().err


def test_linears_left_dense_are_named_once_per_load(capsys):
    # hidden 64 and FFN 96: no linear's input width is a multiple of 128 (2 layers of qkv, o, gate_up, down; lm_head)
    err = _load("int4:128", capsys)
    assert err == "tokenhaul: --quantization int4:128: 9 of 9 linears kept dense bf16 (no int4 kernel for " \
                  "groups of 128 at input width 64, 96)\n"
    # FFN 128: the two down projections take groups of 128, the rest stay dense
    err = _load("int4:128", capsys, ffn_size=128)
    assert err.count("\n") == 1 and "7 of 9 linears kept dense bf16" in err and "input width 64)" in err


def test_every_linear_packed_says_nothing(capsys):
    assert _load("int4:32", capsys) == ""
    assert _load("none", capsys) == ""


def test_a_cpu_without_the_int4_layout_is_named_not_the_widths(capsys, monkeypatch):
    """On a scalar torch build (no AVX2 / AVX-512: block_n() is None) every int4 linear stays dense whatever its
    width: the line says so instead of blaming input widths that int4:32 takes."""
    from tokenhaul.layers import linear_int4

    monkeypatch.setattr(linear_int4, "block_n", lambda: None)
    err = _load("int4:32", capsys)
    assert err == "tokenhaul: --quantization int4:32: 9 of 9 linears kept dense bf16 (torch's CPU int4 layout " \
                  "needs AVX2 or AVX-512; this build has neither)\n"


def test_auto_without_the_int4_layout_says_so(capsys, monkeypatch):
    """--quantization auto (the default) picks int4 for GGUF 4-bit blocks; on a CPU with no int4 layout those
    linears stay dense, and the load says so in one line instead of silently reading 3-4x the bytes."""
    import numpy as np
    from gguf import GGMLQuantizationType as Q
    from gguf.quants import quantize

    from tokenhaul.layers import linear_int4
    from tokenhaul.layers.gguf_weight import GGUFWeight

    monkeypatch.setattr(linear_int4, "block_n", lambda: None)
    make = LinearFactory(QuantSpec.parse("auto"), torch.bfloat16)
    data = quantize(np.random.default_rng(0).standard_normal((64, 256), dtype=np.float32) * 0.1, Q.Q4_0)
    lin = make.linear("a", [GGUFWeight(Q.Q4_0, (64, 256), data.reshape(64, -1))])
    make.linear("b", [torch.randn(32, 256)])  # a float tensor: dense by choice, not a fallback
    make.say_fallbacks()
    assert lin.format == "dense"
    assert capsys.readouterr().err == "tokenhaul: --quantization auto: 1 of 2 linears kept dense bf16 (torch's " \
                                      "CPU int4 layout needs AVX2 or AVX-512; this build has neither)\n"
