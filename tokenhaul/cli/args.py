"""The flags shared by the engine commands: the engine's options and one flag per SamplingParams field."""

from __future__ import annotations

import argparse
import dataclasses
import json
import os

from tokenhaul.errors import RequestError
from tokenhaul.models import catalog
from tokenhaul.sampling_params import SamplingParams


def add_engine_args(p: argparse.ArgumentParser) -> None:
    """The engine's options as flags; engine_kwargs() turns them into LLM keyword arguments."""
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
    p.add_argument("--max-model-len", type=int, default=None,
                   help="context length (default 8192, or the model's if shorter; more than the model's is an error)")
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
    """The LLM keyword arguments that add_engine_args' flags set."""
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
        elif f.name.endswith("_ids"):  # vLLM's comma form (30,198) or the flag repeated
            p.add_argument(flag, type=token_ids, action="extend", default=None, metavar="ID[,ID...]",
                           help="comma-separated token ids, or repeat the flag")
        elif isinstance(default, list):
            p.add_argument(flag, action="append", default=None, help="repeat the flag for several values")
        else:
            typ = float if isinstance(default, float) else str if isinstance(default, str) else int
            p.add_argument(flag, type=typ, default=default)


def token_ids(text: str) -> list[int]:
    """'30,198' → [30, 198] (argparse reports a malformed value)."""
    return [int(t) for t in text.split(",")]


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
    """The SamplingParams that add_sampling_args' flags set (a one-line RequestError for a malformed value)."""
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
