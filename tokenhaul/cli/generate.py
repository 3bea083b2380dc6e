"""`generate` and `chat`: one prompt through the offline engine, its text (or JSON) and ledger."""

from __future__ import annotations

import argparse
import json
import sys
import time
from typing import TYPE_CHECKING

from tokenhaul.cli.args import add_engine_args, add_sampling_args, engine_kwargs, sampling_params

if TYPE_CHECKING:
    from tokenhaul.outputs import RequestOutput


def add_parsers(sub: argparse._SubParsersAction) -> None:
    for name in ("generate", "chat"):
        g = sub.add_parser(name, help=f"{name} from a prompt and print the text and ledger")
        add_engine_args(g)
        add_sampling_args(g)
        g.add_argument("--prompt", required=True)
        g.add_argument("--chat", action="store_true", help="apply the model's chat template")
        g.add_argument("--json", action="store_true", help="print one JSON object")
        g.add_argument("--ledger", action="store_true", help="print the ledger's short form")
        g.set_defaults(func=lambda a, chat=(name == "chat"): cmd_generate(a, chat))


def options_line(llm) -> str:
    """The byte-saving options a run used, for reports: compute dtype and KV cache dtype with its bytes."""
    c = llm.config
    kv = str(c.kv_torch_dtype).removeprefix("torch.")
    if kv == "int8":
        kv += ", keys less their channel centers"
    return (f"{llm.files.name} quantization {c.quantization}, dtype {c.dtype}, kv {c.kv_dtype} → {kv} "
            f"({llm.costs.kv_bytes_per_token / 1e3:.1f} kB KV per token), sparsity {c.sparsity:g}")


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
    logprobs = _logprob_rows(out.logprobs, out.token_ids, params.logprobs) if params.logprobs is not None else None
    prompt_logprobs = (None if out.prompt_logprobs is None else [None] + _logprob_rows(
        out.prompt_logprobs[1:], out.prompt_token_ids[1:], params.prompt_logprobs))
    if args.json:
        print(json.dumps({"text": out.text, "token_ids": out.token_ids, "logprobs": logprobs,
                          "prompt_token_ids": out.prompt_token_ids, "prompt_logprobs": prompt_logprobs,
                          "finish_reason": out.finish_reason, "stop_reason": out.stop_reason,
                          "beams": [{"text": b.text, "token_ids": b.token_ids, "score": b.score}
                                    for b in out.beams or []],
                          "outputs": [{"index": o.index, "text": o.text, "token_ids": o.token_ids,
                                       "cumulative_logprob": o.cumulative_logprob, "finish_reason": o.finish_reason,
                                       "stop_reason": o.stop_reason} for o in out.outputs],
                          "ledger": out.ledger.summary() | {"load_seconds": load_s}}, ensure_ascii=False))
        return
    print_outputs(out)
    for label, rows in (("prompt logprob", (prompt_logprobs or [None])[1:]), ("logprob", logprobs or [])):
        for e in rows:
            top = "  ".join(f"{llm.tokenizer.decode([t], skip_special_tokens=False)!r} {v:.3f}" for t, v in e["top"])
            print(f"[{label}] {e['token']!r} {e['logprob']:.3f}" + (f"  | top: {top}" if top else ""),
                  file=sys.stderr)
    if args.ledger:
        print(f"\n[ledger] {options_line(llm)} | {out.ledger.short_line()} | "
              f"finish={out.finish_reason}", file=sys.stderr)


def print_outputs(out: RequestOutput) -> None:
    """The text; with several beams or samples, each under a header (its number and score or finish reason)."""
    if out.beams is not None and len(out.beams) > 1:
        heads = [(f"[beam {i}] score {b.score:.4f}", b.text) for i, b in enumerate(out.beams, 1)]
    elif out.beams is None and len(out.outputs) > 1:
        heads = [(f"[sample {o.index + 1}] finish={o.finish_reason}", o.text) for o in out.outputs]
    else:
        print(out.text)
        return
    print("\n\n".join(f"{head}\n{text}" for head, text in heads))


def _logprob_rows(logprobs: list[dict] | None, token_ids: list[int], k: int) -> list[dict]:
    """The offline API's logprobs (vLLM's dicts, token id -> Logprob) as --json and the stderr lines show them: per
    token its text, id, logprob, rank among the vocabulary, and the k most likely as [id, logprob] pairs best
    first."""
    rows = []
    for d, t in zip(logprobs or [], token_ids):
        top = sorted((v.rank, tid, v.logprob) for tid, v in d.items() if v.rank is not None and v.rank <= k)
        rows.append({"token": d[t].decoded_token, "token_id": t, "logprob": d[t].logprob, "rank": d[t].rank,
                     "top": [[tid, v] for _, tid, v in top]})
    return rows
