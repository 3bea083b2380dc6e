"""tokenhaul command line: generate | chat | models (serve, trace and bench join as they land)."""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time

from tokenhaul.errors import TokenhaulError
from tokenhaul.models import catalog
from tokenhaul.sampling_params import SamplingParams


def add_engine_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=catalog.DEFAULT_MODEL, help="catalog alias or path to a GGUF file")
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="fp32", help="compute dtype for weights: fp32 (default) or bf16")
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--kv-memory", type=float, default=1.0, dest="kv_memory_gib", help="KV cache budget, GiB")
    p.add_argument("--num-kv-blocks", type=int, default=None, help="KV cache budget in blocks (overrides)")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--max-model-len", type=int, default=8192)
    p.add_argument("--max-num-batched-tokens", type=int, default=512)
    p.add_argument("--max-num-seqs", type=int, default=64)
    p.add_argument("--no-prefix-cache", action="store_false", dest="enable_prefix_caching")


def engine_kwargs(args: argparse.Namespace) -> dict:
    keys = ("device", "dtype", "threads", "kv_memory_gib", "num_kv_blocks", "block_size", "max_model_len",
            "max_num_batched_tokens", "max_num_seqs", "enable_prefix_caching")
    return {k: getattr(args, k) for k in keys}


def add_sampling_args(p: argparse.ArgumentParser) -> None:
    """One flag per SamplingParams field, same name and default, so the two never drift."""
    for f in dataclasses.fields(SamplingParams):
        flag = "--" + f.name.replace("_", "-")
        default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
        if isinstance(default, bool):
            p.add_argument(flag, action="store_true", default=default)
        elif isinstance(default, list):
            elem = int if f.name.endswith("_ids") else str
            p.add_argument(flag, type=elem, action="append", default=None,
                           help="repeat the flag for several values")
        else:
            typ = float if isinstance(default, float) else int
            p.add_argument(flag, type=typ, default=default)


def sampling_params(args: argparse.Namespace) -> SamplingParams:
    kw = {}
    for f in dataclasses.fields(SamplingParams):
        v = getattr(args, f.name)
        if v is not None or f.name in ("seed", "logprobs"):
            kw[f.name] = v
    return SamplingParams(**kw)


def cmd_generate(args: argparse.Namespace, chat: bool = False) -> None:
    from tokenhaul.llm import LLM

    params = sampling_params(args)
    t0 = time.perf_counter()
    llm = LLM(args.model, **engine_kwargs(args))
    load_s = time.perf_counter() - t0
    if chat or args.chat:
        out = llm.chat([{"role": "user", "content": args.prompt}], params)[0]
    else:
        out = llm.generate(args.prompt, params)[0]
    summary = out.ledger.summary()
    if args.json:
        print(json.dumps({"text": out.text, "token_ids": out.token_ids,
                          "prompt_token_ids": out.prompt_token_ids, "finish_reason": out.finish_reason,
                          "ledger": summary | {"load_seconds": load_s}}, ensure_ascii=False))
        return
    print(out.text)
    if args.ledger:
        print(f"\n[ledger] {llm.files.name} {args.dtype} | {out.ledger.short_line()} | "
              f"finish={out.finish_reason}", file=sys.stderr)


def cmd_models(args: argparse.Namespace) -> None:
    if args.action == "install":
        for alias in args.aliases:
            catalog.install(alias)
            files = catalog.resolve(alias)  # joins and verifies once
            print(f"{alias}: installed, verified {files.gguf_path}")
        return
    for row in catalog.listing():
        mark = "installed" if row["installed"] else "not installed"
        star = " (default)" if row["default"] else ""
        print(f"{row['alias']:<20} {mark:<14} {row['size_mb']:>6} MB  {row['description']}{star}")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="tokenhaul", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    for name in ("generate", "chat"):
        g = sub.add_parser(name, help=f"{name} from a prompt and print the text and ledger")
        add_engine_args(g)
        add_sampling_args(g)
        g.add_argument("--prompt", required=True)
        g.add_argument("--chat", action="store_true", help="apply the model's chat template")
        g.add_argument("--json", action="store_true", help="print one JSON object")
        g.add_argument("--ledger", action="store_true", help="print the ledger's short form")
        g.set_defaults(func=lambda a, chat=(name == "chat"): cmd_generate(a, chat))
    m = sub.add_parser("models", help="list catalog models, or `models install ALIAS`")
    m.add_argument("action", nargs="?", choices=["list", "install"], default="list")
    m.add_argument("aliases", nargs="*")
    m.set_defaults(func=cmd_models)
    return parser


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    try:
        args.func(args)
    except TokenhaulError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
    except KeyboardInterrupt:
        sys.exit(130)


if __name__ == "__main__":
    main()
