"""Batch-1 decode attention inside a compiled graph, as engine/compiled_decode.py runs it: all layers of a
SmolLM2- or Qwen2.5-0.5B-shaped bf16 paged cache (16-slot blocks shuffled as after churn), one query, the mask
built in the graph. Two ways, each torch.compile'd (inductor, cpp_wrapper) per context length and timed in
interleaved rounds in one process:

  fused    the block-table lookup written as products and sums that inductor fuses into its reductions
           (layers/attention.py: _decode_traced)
  kernel   the C++ decode kernel over the bf16 blocks (kv/decode_attention.py: decode_bf16)

Prints ms per step (median of --repeats) and the KV read rate; ratio = fused ÷ kernel.

    flock -x /tmp/tokenhaul-bench.lock .venv/bin/python bench/compiled_attention.py
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from tokenhaul.kv import decode_attention
from tokenhaul.layers.attention import AttnGroup, _decode_traced

SHAPES = {"smollm2-135m": (9, 3, 64, 30), "qwen2.5-0.5b": (14, 2, 64, 24)}  # heads, KV heads, head dim, layers
BS = 16


def step(kind: str, layers: int):
    def run(q: torch.Tensor, ks: list[torch.Tensor], vs: list[torch.Tensor], table: torch.Tensor,
            pos: torch.Tensor) -> torch.Tensor:
        mask = (torch.arange(table.shape[1] * BS) <= pos).view(1, 1, 1, -1)
        g = AttnGroup(1, 1, None, table, mask, mask)
        out = q.new_zeros(q.shape[0], q.shape[1] * q.shape[2])
        for i in range(layers):
            if kind == "fused":
                o = _decode_traced(q, ks[i], vs[i], g, mask, 0.125)
            else:
                B, H, D = q.shape
                hkv = ks[i].shape[2]
                o = decode_attention.decode_bf16(q.view(B, hkv, H // hkv, D), ks[i], vs[i], table, mask,
                                                 0.125).reshape(B, H * D)
            out = out + o.to(out.dtype)
        return out
    return run


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default="smollm2-135m,qwen2.5-0.5b")
    ap.add_argument("--contexts", default="128,512,1024,4096")
    ap.add_argument("--repeats", type=int, default=30)
    args = ap.parse_args()
    assert decode_attention.available(), "the decode kernel did not build"
    torch.manual_seed(0)
    print("| model | context | fused ms | kernel ms | kernel KV GB/s | fused ÷ kernel |")
    print("|---|---|---|---|---|---|")
    for model in args.models.split(","):
        H, hkv, D, layers = SHAPES[model]
        for ctx in map(int, args.contexts.split(",")):
            nb = -(-ctx // BS)
            pool = 2 * nb + 8  # blocks in the pool: the sequence's are a shuffled half
            ks = [torch.randn(pool, BS, hkv, D).bfloat16() for _ in range(layers)]
            vs = [torch.randn(pool, BS, hkv, D).bfloat16() for _ in range(layers)]
            table = torch.randperm(pool)[:nb].view(1, nb)
            q = torch.randn(1, H, D).bfloat16()
            pos = torch.tensor([ctx - 1])
            torch._dynamo.reset()  # a fresh graph per shape (dynamo's recompile limit)
            fns = {k: torch.compile(step(k, layers), dynamic=False, fullgraph=True, options={"cpp_wrapper": True})
                   for k in ("fused", "kernel")}
            with torch.inference_mode():
                outs = {k: f(q, ks, vs, table, pos) for k, f in fns.items()}
                assert torch.allclose(outs["fused"], outs["kernel"], atol=2e-2, rtol=2e-2)
                times: dict[str, list[float]] = {k: [] for k in fns}
                for _ in range(args.repeats):
                    for k, f in fns.items():
                        t0 = time.perf_counter()
                        f(q, ks, vs, table, pos)
                        times[k].append(time.perf_counter() - t0)
            fused, kernel = (statistics.median(times[k]) for k in ("fused", "kernel"))
            kv_bytes = 2 * layers * nb * BS * hkv * D * 2
            print(f"| {model} | {ctx} | {fused * 1e3:.2f} | {kernel * 1e3:.2f} | {kv_bytes / kernel / 1e9:.1f} | "
                  f"{fused / kernel:.2f}× |", flush=True)


if __name__ == "__main__":
    main()
