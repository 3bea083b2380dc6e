"""`calibrate` (the machine's roofline) and `calibrate-sparsity` (a model's activation-sparsity thresholds)."""

from __future__ import annotations

import argparse
import json

from tokenhaul.cli.args import add_engine_args, engine_kwargs


def add_parsers(sub: argparse._SubParsersAction) -> None:
    cs = sub.add_parser("calibrate-sparsity", help="calibrate activation-sparsity thresholds for a model (cached)")
    add_engine_args(cs)
    cs.set_defaults(func=cmd_calibrate_sparsity)
    c = sub.add_parser("calibrate", help="measure read bandwidth and fp32 GEMM FLOP/s for the roofline")
    c.add_argument("--device", default="cpu")
    c.add_argument("--threads", type=int, default=None)
    c.set_defaults(func=cmd_calibrate)


def cmd_calibrate(args: argparse.Namespace) -> None:
    import torch

    from tokenhaul.whatif.calibrate import calibrate, calibration_path

    if args.threads:
        torch.set_num_threads(args.threads)
    roof, entry = calibrate(args.device)
    cached = (f" ({roof.resident_bandwidth / 1e9:.1f} GB/s over {roof.resident_bytes / 2**20:.0f} MiB in the "
              f"last-level cache)") if roof.resident_bytes else ""
    print(f"{roof.key}: read {roof.bandwidth / 1e9:.1f} GB/s{cached}, fp32 GEMM {roof.peak_flops / 1e9:.0f} GFLOP/s, "
          f"ridge {roof.ridge:.1f} FLOP/byte (measured in {entry['measure_seconds']:.1f} s) → {calibration_path()}")


def cmd_calibrate_sparsity(args: argparse.Namespace) -> None:
    from tokenhaul.layers.sparse_calibration import calibration_path, load_or_calibrate
    from tokenhaul.llm import LLM

    llm = LLM(args.model, **(engine_kwargs(args) | {"sparsity": 0.0, "enable_prefix_caching": False}))
    th = load_or_calibrate(llm, args.sparsity or 0.4, force=True)
    data = json.loads(calibration_path(llm.files.cache_dir).read_text())
    print(f"{llm.files.name}: thresholds for sparsity {', '.join(data['levels'])} over {len(th)} projections "
          f"({data['sample']}) in {data['seconds']:.1f} s → {calibration_path(llm.files.cache_dir)}")
