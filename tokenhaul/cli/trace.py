"""`trace`: a run's Perfetto trace, HTML ledger report and step records, or a running server's ledger."""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
from pathlib import Path
from typing import TYPE_CHECKING

from tokenhaul.cli.args import add_engine_args, add_sampling_args, engine_kwargs, sampling_params
from tokenhaul.cli.generate import options_line
from tokenhaul.errors import TokenhaulError
from tokenhaul.models import catalog
from tokenhaul.sampling_params import SamplingParams

if TYPE_CHECKING:
    from tokenhaul.llm import LLM


def add_parsers(sub: argparse._SubParsersAction) -> None:
    t = sub.add_parser("trace", help="run prompts, write a Perfetto trace and an HTML ledger report")
    add_engine_args(t)
    add_sampling_args(t)
    t.add_argument("--prompt", action="append", help="repeat for several prompts")
    t.add_argument("--url", default=None, help="instead: save a running server's ledger (all its replicas)")
    t.add_argument("--concurrency", type=int, default=1, help="requests run together, at least one per --prompt "
                   "(a larger number cycles the prompts)")
    t.add_argument("--chat", action="store_true", help="apply the model's chat template")
    t.add_argument("--out", required=True, help="directory for trace.json and report.html")
    t.set_defaults(func=cmd_trace)


def out_dir(path: str) -> Path:
    """--out as a directory this process can write into (made if missing), checked before any work is done."""
    out = Path(path)
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as e:  # FileExistsError: a file of that name; else a missing or unwritable parent
        raise TokenhaulError(f"--out {out}: cannot be made a directory for the trace files ({e.strerror})") from None
    if not os.access(out, os.W_OK | os.X_OK):
        raise TokenhaulError(f"--out {out}: the directory is not writable")
    return out


def cmd_trace(args: argparse.Namespace) -> None:
    if args.url:
        return trace_server(args.url, out_dir(args.out))
    if not args.prompt:
        raise TokenhaulError("trace needs --prompt (or --url of a running server)")
    if args.concurrency < 1:
        raise TokenhaulError(f"--concurrency must be at least 1, got {args.concurrency}")
    out = out_dir(args.out)
    from tokenhaul.ledger.perfetto import write_trace
    from tokenhaul.ledger.report import text_report, write_report
    from tokenhaul.llm import LLM
    from tokenhaul.whatif.calibrate import machine_roofline

    params = sampling_params(args)
    llm = LLM(args.model, **engine_kwargs(args))
    roof = machine_roofline(llm.costs.device)  # measured now if missing, not inside the traced run
    llm.generate("Warm up.", SamplingParams(max_tokens=2))  # first-call costs stay out of the trace
    n = max(args.concurrency, len(args.prompt))  # every prompt runs; a larger --concurrency cycles them
    prompts = [args.prompt[i % len(args.prompt)] for i in range(n)]
    if args.chat:
        outs = llm.chat([[{"role": "user", "content": p}] for p in prompts], params)
    else:
        outs = llm.generate(prompts, params)
    ledger = outs[0].ledger
    trace = write_trace(ledger, out / "trace.json")
    title = f"tokenhaul ledger: {options_line(llm)}, {n} concurrent"
    report = write_report(ledger, out / "report.html", roof, title)
    steps = out / "steps.jsonl"
    with steps.open("w") as f:  # the step records, so the run can be replayed through the what-if model
        for s in ledger.steps:
            f.write(json.dumps(dataclasses.asdict(s.record)) + "\n")
    (out / "run.json").write_text(json.dumps(run_options(llm, args.model)))  # whatif --replay reads it
    print(f"options: {options_line(llm)}")
    print(text_report(ledger, roof))
    print(f"\ntrace:  {trace}  (open in https://ui.perfetto.dev)\nreport: {report}\nsteps:  {steps}")


def run_options(llm: LLM, model: str) -> dict:
    """The traced run's model (an alias, or the GGUF's absolute path) and byte options in the what-if model's terms
    (whatif/workload.py): the weights' most common storage format (sparse layers: the format they wrap; dense ones
    named by the compute dtype), the KV cache's dtype, the sparsity."""
    import torch

    c = llm.config
    formats = dict(llm.costs.weight_formats)
    fmt = max(formats, key=formats.get) if formats else "dense"
    if fmt == "sparse":
        fmt = llm.model.layers[0].gate_up.storage  # int4, int8 or dense
    dtype = {torch.float32: "fp32", torch.bfloat16: "bf16"}
    return {"model": model if model in catalog.CATALOG else str(llm.files.gguf_path.resolve()),
            "quantization": fmt if fmt in ("int4", "int8") else dtype[c.torch_dtype],
            "kv_dtype": "int8" if c.kv_torch_dtype == torch.int8 else dtype[c.kv_torch_dtype], "sparsity": c.sparsity}


def trace_server(url: str, out: Path) -> None:
    """A running server's ledger, every replica's: steps.jsonl (each record names its replica; replay
    it with `whatif --replay`) and ledger.json (totals, prefix-miss cost, routing)."""
    import httpx

    try:
        r = httpx.get(url.rstrip("/") + "/ledger", params={"since": -1}, timeout=60)
    except httpx.HTTPError as e:
        raise TokenhaulError(f"cannot reach {url}: {e}") from None
    if r.status_code != 200:
        raise TokenhaulError(f"{url}/ledger answered HTTP {r.status_code}: {r.text[:200]}")
    led = r.json()
    (out / "run.json").unlink(missing_ok=True)  # an earlier local trace's: not this server's options
    with (out / "steps.jsonl").open("w") as f:
        for snap in led["replicas"].values():
            for rec in snap.pop("step_records"):
                f.write(json.dumps(rec) + "\n")
    (out / "ledger.json").write_text(json.dumps(led, indent=2))
    for name, s in led["replicas"].items():
        miss = s["prefix_miss"]
        print(f"replica {name} ({s.get('where', 'in-process')}): {s['steps']} steps | prompt "
              f"{s['prompt_tokens_computed']} tok computed @ {s['prefill_tokens_per_s']:.0f} tok/s | "
              f"{s['generated_tokens']} tok generated: {s['decode_tokens']} in decode steps @ "
              f"{s['decode_tokens_per_s']:.1f} tok/s | TTFT p50 "
              f"{s['ttft_ms']['p50']:.0f} ms (core side) | prefix misses {miss['tokens']} tok = "
              f"{miss['kv_bytes'] / 1e6:.1f} MB KV, {miss['bytes_moved'] / 1e9:.2f} GB moved")
    if led["routing"]:
        print("routing: " + " ".join(f"{k} {v}" for k, v in led["routing"].items()))
    print(f"steps:  {out / 'steps.jsonl'}\nledger: {out / 'ledger.json'}")
