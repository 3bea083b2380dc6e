"""`whatif`: a workload's predicted speed on hardware profiles, or a traced run replayed against the model."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from tokenhaul.errors import TokenhaulError
from tokenhaul.models import catalog


def add_parsers(sub: argparse._SubParsersAction) -> None:
    w = sub.add_parser("whatif", help="predict a workload on hardware you do not have (analytic, calibrated here)")
    w.add_argument("--model", default=catalog.DEFAULT_MODEL,
                   help="catalog alias, GGUF file, or a transformers config.json (need not be installed)")
    w.add_argument("--hardware", default="this-machine", help="profile name (whatif/hardware/*.toml) or a .toml path")
    w.add_argument("--compare", default=None, help="profiles side by side, e.g. h100,groq-lpu,hbm-pim")
    w.add_argument("--batch", type=int, default=1)
    w.add_argument("--context", type=int, default=512, help="prompt tokens per sequence")
    w.add_argument("--new-tokens", type=int, default=128)
    w.add_argument("--quantization", default="bf16", help="weights: fp32, bf16, fp8, int8, int4")
    w.add_argument("--kv-dtype", default="bf16", help="KV cache: fp32, bf16, fp8, int8")
    w.add_argument("--sparsity", type=float, default=0.0, help="share of FFN neurons skipped per token")
    w.add_argument("--decoding", default="greedy", help="greedy | speculative:k=4,a=0.7[,draft=MODEL]")
    w.add_argument("--max-batched-tokens", type=int, default=512)
    w.add_argument("--json", action="store_true", help="print one JSON object (a list with --compare)")
    w.add_argument("--plots", default=None, help="directory for roofline.png, batch.png, context.png")
    w.add_argument("--replay", default=None, help="steps.jsonl from `tokenhaul trace`: predicted vs measured per step")
    w.set_defaults(func=cmd_whatif)


def cmd_whatif(args: argparse.Namespace) -> None:
    from tokenhaul.whatif import report
    from tokenhaul.whatif.hardware import load_hardware
    from tokenhaul.whatif.modelspec import load_model_config
    from tokenhaul.whatif.workload import Workload, parse_decoding, predict

    name, cfg = load_model_config(args.model)
    w = Workload(name, cfg, args.batch, args.context, args.new_tokens, args.quantization, args.kv_dtype,
                 args.sparsity, parse_decoding(args.decoding), args.max_batched_tokens)
    if args.replay:
        from tokenhaul.whatif.replay import replay

        print(replay(Path(args.replay), w, load_hardware(args.hardware)))
        return
    if not args.compare:
        preds = [predict(w, load_hardware(args.hardware))]
    else:
        preds = [p for n in args.compare.split(",") if (p := report.try_predict(w, load_hardware(n)))]
        for n in args.compare.split(","):
            if n not in {p.hardware.name for p in preds}:
                print(f"{n}: the weights and KV do not fit", file=sys.stderr)
        if not preds:
            raise TokenhaulError("the workload fits none of the compared profiles")
    if args.json:
        print(json.dumps(preds[0].as_dict() if len(preds) == 1 else [p.as_dict() for p in preds]))
    else:
        print(report.text(preds))
    if args.plots:
        paths = report.plots(preds, Path(args.plots))
        print("plots: " + ", ".join(map(str, paths)), file=sys.stderr)
