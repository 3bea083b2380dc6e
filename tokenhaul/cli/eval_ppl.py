"""`eval ppl`: perplexity with sliding windows over the shipped corpus or a file."""

from __future__ import annotations

import argparse
import json

from tokenhaul.cli.args import add_engine_args, engine_kwargs
from tokenhaul.errors import TokenhaulError


def add_parsers(sub: argparse._SubParsersAction) -> None:
    e = sub.add_parser("eval", help="quality: `eval ppl` (perplexity over the shipped corpus or a file)")
    esub = e.add_subparsers(dest="eval_command", required=True)
    ep = esub.add_parser("ppl", help="perplexity with sliding windows (English, Chinese and code corpus)")
    add_engine_args(ep)
    ep.add_argument("--corpus", default=None, help="a UTF-8 text file (default: the shipped corpus)")
    ep.add_argument("--max-tokens", type=int, default=None, help="cap on scored tokens (split across parts)")
    ep.add_argument("--window", type=int, default=512, help="context window per chunk")
    ep.add_argument("--stride", type=int, default=None,
                    help="tokens between window starts (default: 256, at most half the window)")
    ep.add_argument("--decode-tail", type=int, default=0,
                    help="each window's last N tokens enter as one-token decode steps (generation's path: the decode "
                         "attention kernel reading the KV cache, the compiled step), the rest as one prefill chunk")
    ep.add_argument("--json", action="store_true", help="print one JSON object")
    ep.set_defaults(func=cmd_eval_ppl)


def resolve_stride(args: argparse.Namespace) -> int:
    """--stride, or 256 when not given (at most half the window: earlier runs keep their figures)."""
    return min(256, args.window // 2) if args.stride is None else args.stride


def cmd_eval_ppl(args: argparse.Namespace) -> None:
    from tokenhaul.eval.perplexity import evaluate
    from tokenhaul.llm import LLM

    if args.window < 2:
        raise TokenhaulError(f"--window must be >= 2, got {args.window}")
    stride = resolve_stride(args)
    if not 0 < stride <= args.window:
        raise TokenhaulError(f"--stride must be in 1..--window ({args.window}), got {stride}")
    if args.max_tokens is not None and args.max_tokens < 2:
        raise TokenhaulError("--max-tokens must be >= 2")
    if not 0 <= args.decode_tail < args.window:
        raise TokenhaulError("--decode-tail must be >= 0 and < --window")
    kw = engine_kwargs(args) | {"max_num_batched_tokens": max(args.window, args.max_num_batched_tokens),
                                "enable_prefix_caching": False}
    llm = LLM(args.model, **kw)
    res = result(args, llm.files.name, evaluate(llm, args.corpus, args.max_tokens, args.window, stride,
                                                args.decode_tail))
    print(json.dumps(res) if args.json else result_line(res))


def result(args: argparse.Namespace, model: str, measured: dict) -> dict:
    """The --json object: the run's model and byte-saving options, then evaluate()'s figures."""
    return {"model": model, "quantization": args.quantization, "dtype": args.dtype, "kv_dtype": args.kv_dtype,
            "sparsity": args.sparsity, "decode_tail": args.decode_tail, **measured}


def result_line(res: dict) -> str:
    """The one-line text form of `result`: options, perplexity, tokens, each corpus part and the time."""
    parts = ", ".join(f"{k} {v['perplexity']:.3f} ({v['tokens']} tokens)" for k, v in res["parts"].items())
    tail = f", last {res['decode_tail']} of each window decoded" if res["decode_tail"] else ""
    sparse = f" sparsity {res['sparsity']:g}" if res["sparsity"] else ""
    return (f"{res['model']} {res['quantization']} {res['dtype']} kv {res['kv_dtype']}{sparse}{tail}: perplexity "
            f"{res['perplexity']:.4f} over {res['tokens']} tokens [{parts}] in {res['seconds']:.1f} s")
