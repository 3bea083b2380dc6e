"""`whatif`: a workload's predicted speed on hardware profiles, or a traced run replayed against the model."""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from tokenhaul.errors import TokenhaulError
from tokenhaul.models import catalog


def add_parsers(sub: argparse._SubParsersAction) -> None:
    w = sub.add_parser("whatif", help="predict a workload on hardware you do not have (analytic, calibrated here)")
    w.add_argument("--model", default=None, help="catalog alias, GGUF file, or a transformers config.json (need "
                   f"not be installed; default {catalog.DEFAULT_MODEL}, or with --replay the traced run's)")
    w.add_argument("--hardware", default="this-machine", help="profile name (whatif/hardware/*.toml) or a .toml path")
    w.add_argument("--compare", default=None, help="profiles side by side, e.g. h100,groq-lpu,hbm-pim")
    w.add_argument("--batch", type=int, default=1)
    w.add_argument("--context", type=int, default=512, help="prompt tokens per sequence")
    w.add_argument("--new-tokens", type=int, default=128)
    w.add_argument("--quantization", default=None, help="weights: fp32, bf16 (default), fp8, int8, int4")
    w.add_argument("--kv-dtype", default=None, help="KV cache: fp32, bf16 (default), fp8, int8")
    w.add_argument("--sparsity", type=float, default=None, help="share of FFN neurons skipped per token (0)")
    w.add_argument("--decoding", default="greedy", help="greedy | speculative:k=4,a=0.7[,draft=MODEL]")
    w.add_argument("--max-batched-tokens", type=int, default=512)
    w.add_argument("--json", action="store_true", help="print one JSON object (a list with --compare)")
    w.add_argument("--plots", default=None, help="directory for roofline.png, batch.png, context.png")
    w.add_argument("--replay", default=None, help="steps.jsonl from `tokenhaul trace`: predicted vs measured per "
                   "step (model, quantization, KV dtype and sparsity from the run.json beside it, unless given)")
    w.set_defaults(func=cmd_whatif)


def cmd_whatif(args: argparse.Namespace) -> None:
    from tokenhaul.whatif import report
    from tokenhaul.whatif.hardware import load_hardware
    from tokenhaul.whatif.modelspec import load_model_config
    from tokenhaul.whatif.workload import Workload, parse_decoding, predict

    if args.plots and args.replay:
        raise TokenhaulError("--plots draws a workload's predictions; --replay compares a traced run's steps and "
                             "draws nothing: give one of them")
    plots = plots_dir(args.plots) if args.plots else None  # checked before any work, made only to write the plots
    o = workload_options(args)
    name, cfg = load_model_config(o["model"])
    w = Workload(name, cfg, args.batch, args.context, args.new_tokens, o["quantization"], o["kv_dtype"],
                 o["sparsity"], parse_decoding(args.decoding), args.max_batched_tokens)
    if args.replay:
        from tokenhaul.whatif.replay import replay

        _print(replay(Path(args.replay), w, load_hardware(args.hardware)))
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
        _print(json.dumps(preds[0].as_dict() if len(preds) == 1 else [p.as_dict() for p in preds]))
    else:
        _print(report.text(preds))
    if plots is not None:
        plots.mkdir(parents=True, exist_ok=True)
        paths = report.plots(preds, plots)
        print("plots: " + ", ".join(map(str, paths)), file=sys.stderr)


def plots_dir(path: str) -> Path:
    """--plots as a directory this process can write into: made to check, then the directories made here are
    removed again (the plots make it once the work is done, so a failed run leaves nothing behind)."""
    out = Path(path)
    made = [p for p in (out, *out.parents) if not p.exists()]
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as e:  # FileExistsError: a file of that name; else a missing or unwritable parent
        raise TokenhaulError(f"--plots {out}: cannot be made a directory for the plots ({e.strerror})") from None
    writable = os.access(out, os.W_OK | os.X_OK)
    for p in made:  # deepest first
        p.rmdir()
    if not writable:
        raise TokenhaulError(f"--plots {out}: the directory is not writable")
    return out


def _print(text: str) -> None:
    """Print to stdout; a reader gone (`| head -1`) is no error: the rest of the output goes nowhere."""
    try:
        print(text, flush=True)
    except BrokenPipeError:
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # so the exit's flush cannot fail again


def workload_options(args: argparse.Namespace) -> dict:
    """Model, quantization, KV dtype and sparsity: as given, else (with --replay) the traced run's from the run.json
    `tokenhaul trace` writes beside steps.jsonl, else the defaults."""
    given = {k: getattr(args, k) for k in ("model", "quantization", "kv_dtype", "sparsity")}
    run = Path(args.replay).with_name("run.json") if args.replay else None
    traced = _run_options(run) if run is not None and run.is_file() else {}
    defaults = {"model": catalog.DEFAULT_MODEL, "quantization": "bf16", "kv_dtype": "bf16", "sparsity": 0.0}
    return {k: v if v is not None else traced.get(k, defaults[k]) for k, v in given.items()}


def _run_options(run: Path) -> dict:
    """The run.json `tokenhaul trace` wrote, checked: model, quantization and KV dtype strings, sparsity a number."""
    try:
        traced = json.loads(run.read_text())
    except (OSError, ValueError) as e:
        raise TokenhaulError(f"cannot read the traced run's options from {run}: {e}") from None
    if not isinstance(traced, dict):
        raise TokenhaulError(f"{run}: not a JSON object of the traced run's options")
    for k, kind in (("model", str), ("quantization", str), ("kv_dtype", str), ("sparsity", (int, float))):
        if k in traced and (not isinstance(traced[k], kind) or isinstance(traced[k], bool)):
            raise TokenhaulError(f"{run}: {k} is {traced[k]!r}, not a {'number' if k == 'sparsity' else 'string'}")
    return traced
