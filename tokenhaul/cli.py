"""tokenhaul command line: generate | chat | models | serve | bench serve | trace | calibrate | whatif."""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time

from tokenhaul.errors import RequestError, TokenhaulError
from tokenhaul.models import catalog
from tokenhaul.sampling_params import SamplingParams


def add_engine_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=catalog.DEFAULT_MODEL, help="catalog alias or path to a GGUF file")
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="bf16", help="weights and KV dtype: bf16 (default, fastest here) or fp32")
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--quantization", default="auto",
                   help="auto (keep the file's packed bits where a kernel exists), none, int8, int4[:32|64|128]")
    p.add_argument("--kv-dtype", default="auto",
                   help="KV cache: auto (as --dtype), fp32, bf16, int8 (per-token-per-head scales, ~0.53x bf16 bytes)")
    p.add_argument("--sparsity", type=float, default=0.0,
                   help="activation sparsity: share of each projection's inputs zeroed, their weight rows not read "
                        "(0.25, 0.4, 0.5; thresholds calibrated once per model); 0 = off")
    p.add_argument("--kv-memory", type=float, default=1.0, dest="kv_memory_gib", help="KV cache budget, GiB")
    p.add_argument("--num-kv-blocks", type=int, default=None, help="KV cache budget in blocks (overrides)")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--max-model-len", type=int, default=8192)
    p.add_argument("--max-num-batched-tokens", type=int, default=512)
    p.add_argument("--max-num-seqs", type=int, default=64)
    p.add_argument("--no-prefix-cache", action="store_false", dest="enable_prefix_caching")
    p.add_argument("--draft-model", default=None, help="draft model for --speculative draft (same vocabulary)")
    p.add_argument("--draft-quantization", default=None,
                   help="the draft model's --quantization (default: int4 under bf16, its steps are then cheapest; "
                        "else as --quantization)")
    p.add_argument("--deterministic", action="store_true",
                   help="batch-invariant attention: temperature 0 gives the same tokens whatever else is batched "
                        "or cached (slower prefill, see bench/RESULTS.md)")
    p.add_argument("--compile", default=os.environ.get("TOKENHAUL_COMPILE", "auto"), choices=("auto", "on", "off"),
                   help="batch-1 decode as one compiled graph (torch.compile, C++ via g++): auto (default) = with "
                        "bf16 on the CPU, compiled at start when compiled before (seconds), else this run stays "
                        "eager and at exit a detached process compiles for the next (~1 min); on = compile now; off")
    p.add_argument("--itl-target-ms", type=float, default=0.0,
                   help="inter-token budget: prefill chunks are sized so a step's predicted time stays under it "
                        "(or under 1.5x the decodes' own, if more) "
                        "(step times measured on this machine once, then cached); 0 = off (default: on this shared "
                        "machine it cost throughput and TTFT, bench/RESULTS.md 'Smooth streams')")


def engine_kwargs(args: argparse.Namespace) -> dict:
    keys = ("device", "dtype", "kv_dtype", "sparsity", "threads", "quantization", "kv_memory_gib", "num_kv_blocks",
            "block_size", "max_model_len", "max_num_batched_tokens", "max_num_seqs", "enable_prefix_caching",
            "draft_model", "draft_quantization", "itl_target_ms", "deterministic", "compile")
    return {k: getattr(args, k) for k in keys}


def add_sampling_args(p: argparse.ArgumentParser) -> None:
    """One flag per SamplingParams field, same name and default, so the two never drift."""
    for f in dataclasses.fields(SamplingParams):
        if not f.init:  # set by the front end (bad_words' token ids)
            continue
        flag = "--" + f.name.replace("_", "-")
        default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
        if f.name == "structured_outputs":  # StructuredOutputsParams' fields as one JSON object
            p.add_argument(flag, default=None, metavar="JSON",
                           help='constrained output, one of: {"choice": ["yes", "no"]}, {"regex": "..."}, '
                                '{"json": {schema}}, {"json_object": true}, {"grammar": "..."}')
        elif isinstance(default, bool):  # --flag / --no-flag: a default of True can be turned off
            p.add_argument(flag, action=argparse.BooleanOptionalAction, default=default)
        elif isinstance(default, dict):  # logit_bias: token id → bias
            p.add_argument(flag, action="append", default=None, metavar="ID=VALUE",
                           help="token id = bias in [-100, 100] added to its logit (e.g. 42=-100 bans token 42); "
                                "repeat the flag for several ids")
        elif isinstance(default, list) or f.name == "allowed_token_ids":
            elem = int if f.name.endswith("_ids") else str
            p.add_argument(flag, type=elem, action="append", default=None,
                           help="repeat the flag for several values")
        else:
            typ = float if isinstance(default, float) else str if isinstance(default, str) else int
            p.add_argument(flag, type=typ, default=default)


def _json_object(text: str) -> dict:
    """--structured-outputs' value: a JSON object (a one-line error otherwise)."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise RequestError(f"--structured-outputs expects a JSON object: {e}") from None
    if not isinstance(value, dict):
        raise RequestError("--structured-outputs expects a JSON object such as '{\"choice\": [\"yes\", \"no\"]}'")
    return value


def _id_values(pairs: list[str]) -> dict[int, float]:
    """['42=-100', '7=2.5'] → {42: -100.0, 7: 2.5} (a one-line error otherwise)."""
    out = {}
    for s in pairs:
        tid, _, value = s.partition("=")
        try:
            out[int(tid)] = float(value)
        except ValueError:
            raise RequestError(f"--logit-bias expects TOKEN_ID=VALUE (e.g. 42=-100), got {s!r}") from None
    return out


def sampling_params(args: argparse.Namespace) -> SamplingParams:
    kw = {}
    for f in dataclasses.fields(SamplingParams):
        if not f.init:
            continue
        v = getattr(args, f.name)
        if v is not None and f.name == "logit_bias":
            v = _id_values(v)
        if v is not None and f.name == "structured_outputs":
            v = _json_object(v)
        if v is not None or f.name in ("seed", "logprobs"):
            kw[f.name] = v
    return SamplingParams(**kw)


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
    print(out.text)
    for label, rows in (("prompt logprob", (prompt_logprobs or [None])[1:]), ("logprob", logprobs or [])):
        for e in rows:
            top = "  ".join(f"{llm.tokenizer.decode([t], skip_special_tokens=False)!r} {v:.3f}" for t, v in e["top"])
            print(f"[{label}] {e['token']!r} {e['logprob']:.3f}" + (f"  | top: {top}" if top else ""),
                  file=sys.stderr)
    for i, b in enumerate((out.beams or [])[1:], 2):
        print(f"\n[beam {i}] score {b.score:.4f}\n{b.text}")
    if out.beams is None:  # n > 1 samples
        for o in out.outputs[1:]:
            print(f"\n[sample {o.index + 1}] finish={o.finish_reason}\n{o.text}")
    if args.ledger:
        print(f"\n[ledger] {options_line(llm)} | {out.ledger.short_line()} | "
              f"finish={out.finish_reason}", file=sys.stderr)


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


def cmd_models(args: argparse.Namespace) -> None:
    if args.action == "install":
        if not args.aliases:
            raise TokenhaulError(f"models install needs an alias: one of {', '.join(catalog.CATALOG)}")
        for alias in args.aliases:
            catalog.install(alias)
            files = catalog.resolve(alias)  # joins and verifies once
            print(f"{alias}: installed, verified {files.gguf_path}")
        return
    for row in catalog.listing():
        mark = "installed" if row["installed"] else "not installed"
        star = " (default)" if row["default"] else ""
        print(f"{row['alias']:<20} {mark:<14} {row['size_mb']:>6} MB  {row['description']}{star}")


def cmd_trace(args: argparse.Namespace) -> None:
    from pathlib import Path

    if args.url:
        return trace_server(args.url, Path(args.out))
    if not args.prompt:
        raise TokenhaulError("trace needs --prompt (or --url of a running server)")
    if args.concurrency < 1:
        raise TokenhaulError(f"--concurrency must be at least 1, got {args.concurrency}")
    from tokenhaul.ledger.perfetto import write_trace
    from tokenhaul.ledger.report import text_report, write_report
    from tokenhaul.llm import LLM
    from tokenhaul.whatif.calibrate import machine_roofline

    params = sampling_params(args)
    llm = LLM(args.model, **engine_kwargs(args))
    roof = machine_roofline(llm.costs.device)  # measured now if missing, not inside the traced run
    llm.generate("Warm up.", SamplingParams(max_tokens=2))  # first-call costs stay out of the trace
    prompts = [args.prompt[i % len(args.prompt)] for i in range(args.concurrency)]
    if args.chat:
        outs = llm.chat([[{"role": "user", "content": p}] for p in prompts], params)
    else:
        outs = llm.generate(prompts, params)
    ledger = outs[0].ledger
    out = Path(args.out)
    trace = write_trace(ledger, out / "trace.json")
    title = f"tokenhaul ledger: {options_line(llm)}, {args.concurrency} concurrent"
    report = write_report(ledger, out / "report.html", roof, title)
    steps = out / "steps.jsonl"
    with steps.open("w") as f:  # the step records, so the run can be replayed through the what-if model
        for s in ledger.steps:
            f.write(json.dumps(dataclasses.asdict(s.record)) + "\n")
    print(f"options: {options_line(llm)}")
    print(text_report(ledger, roof))
    print(f"\ntrace:  {trace}  (open in https://ui.perfetto.dev)\nreport: {report}\nsteps:  {steps}")


def trace_server(url: str, out) -> None:
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
    out.mkdir(parents=True, exist_ok=True)
    with (out / "steps.jsonl").open("w") as f:
        for snap in led["replicas"].values():
            for rec in snap.pop("step_records"):
                f.write(json.dumps(rec) + "\n")
    (out / "ledger.json").write_text(json.dumps(led, indent=2))
    for name, s in led["replicas"].items():
        miss = s["prefix_miss"]
        print(f"replica {name} ({s.get('where', 'in-process')}): {s['steps']} steps | prompt "
              f"{s['prompt_tokens_computed']} tok computed @ {s['prefill_tokens_per_s']:.0f} tok/s | decode "
              f"{s['generated_tokens']} tok @ {s['decode_tokens_per_s']:.1f} tok/s | TTFT p50 "
              f"{s['ttft_ms']['p50']:.0f} ms (core side) | prefix misses {miss['tokens']} tok = "
              f"{miss['kv_bytes'] / 1e6:.1f} MB KV, {miss['bytes_moved'] / 1e9:.2f} GB moved")
    if led["routing"]:
        print("routing: " + " ".join(f"{k} {v}" for k, v in led["routing"].items()))
    print(f"steps:  {out / 'steps.jsonl'}\nledger: {out / 'ledger.json'}")


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


def cmd_whatif(args: argparse.Namespace) -> None:
    from pathlib import Path

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


def cmd_serve(args: argparse.Namespace) -> None:
    from tokenhaul.server.app import serve
    from tokenhaul.server.async_engine import AsyncEngine
    from tokenhaul.server.guards import ServerOptions

    options = ServerOptions(args.api_key, tuple(args.allowed_hosts) if args.allowed_hosts else None,
                            tuple(args.allowed_origins or ()), not args.no_docs, args.max_body_bytes,
                            args.header_timeout, args.body_timeout, args.keep_alive_timeout,
                            args.enable_auto_tool_choice, args.tool_call_parser)
    if args.replicas:
        from tokenhaul.cluster.pool import ReplicaPool

        pool = ReplicaPool(args.model, args.replicas, engine_kwargs(args), args.ray_address, args.routing)
        engine = AsyncEngine.from_client(pool, args.model, args.served_model_name, args.max_waiting,
                                         args.max_prompt_chars, args.request_timeout)
    else:
        engine = AsyncEngine.from_model(args.model, args.served_model_name, args.max_waiting, args.max_prompt_chars,
                                        args.request_timeout, **engine_kwargs(args))
    serve(engine, args.host, args.port, args.log_level, args.access_log, args.shutdown_timeout, options)


def cmd_eval_ppl(args: argparse.Namespace) -> None:
    from tokenhaul.eval.perplexity import evaluate
    from tokenhaul.llm import LLM

    if args.window < 2 or not 0 < args.stride <= args.window:
        raise TokenhaulError("--window must be >= 2 and 0 < --stride <= --window")
    if args.max_tokens is not None and args.max_tokens < 2:
        raise TokenhaulError("--max-tokens must be >= 2")
    if not 0 <= args.decode_tail < args.window:
        raise TokenhaulError("--decode-tail must be >= 0 and < --window")
    kw = engine_kwargs(args) | {"max_num_batched_tokens": max(args.window, args.max_num_batched_tokens),
                                "enable_prefix_caching": False}
    llm = LLM(args.model, **kw)
    res = {"model": llm.files.name, "quantization": args.quantization, "dtype": args.dtype, "kv_dtype": args.kv_dtype,
           "decode_tail": args.decode_tail,
           **evaluate(llm, args.corpus, args.max_tokens, args.window, args.stride, args.decode_tail)}
    if args.json:
        print(json.dumps(res))
        return
    parts = ", ".join(f"{k} {v['perplexity']:.3f} ({v['tokens']} tokens)" for k, v in res["parts"].items())
    tail = f", last {args.decode_tail} of each window decoded" if args.decode_tail else ""
    print(f"{res['model']} {args.quantization} {args.dtype} kv {args.kv_dtype}{tail}: perplexity "
          f"{res['perplexity']:.4f} over {res['tokens']} tokens [{parts}] in {res['seconds']:.1f} s")


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
    s = sub.add_parser("serve", help="OpenAI-compatible HTTP server (completions, chat, /metrics)")
    add_engine_args(s)
    s.add_argument("--host", default="127.0.0.1")
    s.add_argument("--port", type=int, default=8000)
    s.add_argument("--served-model-name", default=None, help="name clients send as `model` (default: --model)")
    s.add_argument("--max-waiting", type=int, default=256,
                   help="requests without a first token yet; beyond this, 429 (retry later)")
    s.add_argument("--api-key", default=os.environ.get("TOKENHAUL_API_KEY"),
                   help="clients must send 'Authorization: Bearer KEY' (default: $TOKENHAUL_API_KEY; /health "
                        "stays open)")
    s.add_argument("--allowed-hosts", nargs="+", default=None, metavar="HOST",
                   help="Host header names answered ('*.example.org' ok; default: loopback names when bound to "
                        "loopback, else any)")
    s.add_argument("--allowed-origins", nargs="+", default=None, metavar="ORIGIN",
                   help="CORS: browser origins allowed to call the API (default: none)")
    s.add_argument("--no-docs", action="store_true", help="do not serve /docs and /openapi.json")
    s.add_argument("--max-body-bytes", type=int, default=2 * 2**20, help="larger request bodies get 413")
    s.add_argument("--max-prompt-chars", type=int, default=None,
                   help="longer prompts get 400 before tokenizing (default: 32 x the context length)")
    s.add_argument("--header-timeout", type=float, default=10.0,
                   help="seconds a connection has to send a request head")
    s.add_argument("--body-timeout", type=float, default=30.0, help="seconds a request has to send its body (408)")
    s.add_argument("--keep-alive-timeout", type=float, default=5.0, help="idle keep-alive connections close after")
    s.add_argument("--request-timeout", type=float, default=None,
                   help="seconds a request may generate; then it ends with finish_reason 'abort' (default: no limit)")
    s.add_argument("--shutdown-timeout", type=float, default=30.0,
                   help="on SIGTERM/SIGINT: seconds to let requests in flight finish (new ones get 503), then exit 0")
    s.add_argument("--enable-auto-tool-choice", action="store_true",
                   help="serve chat tool_choice 'auto' (the default with tools; else a 400), as vLLM")
    s.add_argument("--tool-call-parser", default=None, choices=["hermes"],
                   help="how 'auto' reads tool calls from the text: hermes (<tool_call> JSON blocks, Qwen2.5)")
    s.add_argument("--log-level", default="info")
    s.add_argument("--access-log", action="store_true")
    s.add_argument("--replicas", type=int, default=0,
                   help="N engine replicas as Ray actors (each --threads threads, its own KV cache) behind this "
                        "endpoint; needs the `ray` extra")
    s.add_argument("--ray-address", default=None,
                   help="join this Ray cluster (`ray start --head` ...); default: start a local Ray instance")
    s.add_argument("--routing", default="cache_aware", choices=["cache_aware", "least_loaded", "round_robin"],
                   help="how --replicas picks a replica for a request")
    s.set_defaults(func=cmd_serve)
    b = sub.add_parser("bench", help="benchmarks: `bench serve` (load generator for OpenAI-compatible servers)")
    bsub = b.add_subparsers(dest="bench_command", required=True)
    from tokenhaul.bench import loadgen

    bs = bsub.add_parser("serve", help="Poisson / closed-loop load against a server: TTFT, TPOT, ITL, E2E, goodput")
    loadgen.add_args(bs)
    bs.set_defaults(func=loadgen.main)
    t = sub.add_parser("trace", help="run prompts, write a Perfetto trace and an HTML ledger report")
    add_engine_args(t)
    add_sampling_args(t)
    t.add_argument("--prompt", action="append", help="repeat for several prompts")
    t.add_argument("--url", default=None, help="instead: save a running server's ledger (all its replicas)")
    t.add_argument("--concurrency", type=int, default=1, help="requests run together (prompts cycle)")
    t.add_argument("--chat", action="store_true", help="apply the model's chat template")
    t.add_argument("--out", required=True, help="directory for trace.json and report.html")
    t.set_defaults(func=cmd_trace)
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
    e = sub.add_parser("eval", help="quality: `eval ppl` (perplexity over the shipped corpus or a file)")
    esub = e.add_subparsers(dest="eval_command", required=True)
    ep = esub.add_parser("ppl", help="perplexity with sliding windows (English, Chinese and code corpus)")
    add_engine_args(ep)
    ep.add_argument("--corpus", default=None, help="a UTF-8 text file (default: the shipped corpus)")
    ep.add_argument("--max-tokens", type=int, default=None, help="cap on scored tokens (split across parts)")
    ep.add_argument("--window", type=int, default=512, help="context window per chunk")
    ep.add_argument("--stride", type=int, default=256, help="tokens between window starts")
    ep.add_argument("--decode-tail", type=int, default=0,
                    help="each window's last N tokens enter as one-token decode steps (generation's path: the decode "
                         "attention kernel reading the KV cache, the compiled step), the rest as one prefill chunk")
    ep.add_argument("--json", action="store_true", help="print one JSON object")
    ep.set_defaults(func=cmd_eval_ppl)
    cs = sub.add_parser("calibrate-sparsity", help="calibrate activation-sparsity thresholds for a model (cached)")
    add_engine_args(cs)
    cs.set_defaults(func=cmd_calibrate_sparsity)
    c = sub.add_parser("calibrate", help="measure read bandwidth and fp32 GEMM FLOP/s for the roofline")
    c.add_argument("--device", default="cpu")
    c.add_argument("--threads", type=int, default=None)
    c.set_defaults(func=cmd_calibrate)
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
