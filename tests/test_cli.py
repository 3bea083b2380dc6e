"""Bad input gives one clear line on stderr (exit 2), never a traceback; --json has its fields."""

from __future__ import annotations

import dataclasses
import json
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from tokenhaul.cli import main
from tokenhaul.models import catalog
from tokenhaul.outputs import BeamOutput, CompletionOutput, RequestOutput


def run_cli(capsys, *argv) -> tuple[int, str, str]:
    try:
        main(list(argv))
        code = 0
    except SystemExit as e:
        code = e.code
    out, err = capsys.readouterr()
    return code, out, err


def assert_one_line_error(code, err, fragment):
    assert code == 2
    lines = [ln for ln in err.strip().splitlines() if ln]
    assert len(lines) == 1 and lines[0].startswith("error:"), err
    assert "Traceback" not in err and fragment in lines[0]


def test_unknown_alias(capsys):
    code, _, err = run_cli(capsys, "generate", "--model", "llama-9000", "--prompt", "hi")
    assert_one_line_error(code, err, "unknown model 'llama-9000'")


def test_not_a_gguf(capsys, tmp_path):
    f = tmp_path / "weights.gguf"
    f.write_bytes(b"PK\x03\x04 definitely a zip")
    code, _, err = run_cli(capsys, "generate", "--model", str(f), "--prompt", "hi")
    assert_one_line_error(code, err, "not a GGUF file")


def test_unsupported_architecture(capsys, tmp_path, monkeypatch):
    import gguf

    monkeypatch.setenv("TOKENHAUL_CACHE", str(tmp_path / "cache"))
    f = tmp_path / "mamba.gguf"
    w = gguf.GGUFWriter(str(f), "mamba")
    w.add_block_count(1)
    w.add_tensor("token_embd.weight", np.zeros((4, 8), dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    code, _, err = run_cli(capsys, "generate", "--model", str(f), "--prompt", "hi")
    assert_one_line_error(code, err, "unsupported architecture 'mamba'")


def test_corrupted_part(capsys, tmp_path, monkeypatch):
    monkeypatch.setenv("TOKENHAUL_CACHE", str(tmp_path))
    good = catalog.CATALOG["smollm2-135m"]
    broken = dataclasses.replace(good, alias="broken", sha256="0" * 64)
    monkeypatch.setitem(catalog.CATALOG, "broken", broken)
    code, _, err = run_cli(capsys, "generate", "--model", "broken", "--prompt", "hi")
    assert_one_line_error(code, err, "sha256 mismatch")


@pytest.mark.parametrize("args,fragment", [
    (["--max-tokens", "0"], "max_tokens"),
    (["--max-tokens", "-4"], "max_tokens"),
    (["--top-p", "1.5"], "top_p"),
    (["--top-p", "0"], "top_p"),
    (["--speculative", "medusa"], "speculative must be one of off, prompt_lookup, draft, jacobi"),
    (["--num-speculative-tokens", "0"], "num_speculative_tokens"),
    (["--logit-bias", "5"], "--logit-bias expects TOKEN_ID=VALUE"),
    (["--logit-bias", "x=1"], "--logit-bias expects TOKEN_ID=VALUE"),
    (["--logit-bias", "5=200"], "logit_bias values must be numbers in [-100, 100]"),
    (["--structured-outputs", "[1]"], "--structured-outputs expects a JSON object"),
    (["--structured-outputs", "{choice"], "--structured-outputs expects a JSON object"),
    (["--structured-outputs", '{"regex": "("}'], "structured_outputs.regex is invalid"),
])
def test_bad_sampling_flags(capsys, args, fragment):
    code, _, err = run_cli(capsys, "generate", "--prompt", "hi", *args)
    assert_one_line_error(code, err, fragment)


@pytest.mark.parametrize("value,fragment", [("int4:48", "group must be one of 32, 64, 128"),
                                             ("fp4", "unknown quantization 'fp4'"),
                                             ("int4:", "'int4:': no group after ':'"),
                                             ("auto:", "'auto:': auto takes no group"),
                                             ("int8:64", "'int8:64': int8 takes no group")])
def test_bad_quantization(capsys, value, fragment):
    code, _, err = run_cli(capsys, "generate", "--prompt", "hi", "--quantization", value)
    assert_one_line_error(code, err, fragment)


@pytest.mark.real_model
def test_empty_and_too_long_prompt(capsys):
    code, _, err = run_cli(capsys, "generate", "--prompt", "")
    assert_one_line_error(code, err, "prompt is empty")
    code, _, err = run_cli(capsys, "generate", "--prompt", "word " * 300, "--max-model-len", "128")
    assert_one_line_error(code, err, "context holds 128")


@pytest.mark.real_model
def test_generate_json(capsys):
    code, out, _ = run_cli(capsys, "generate", "--prompt", "The capital of France is", "--max-tokens", "8",
                           "--temperature", "0", "--ignore-eos", "--json")
    assert code == 0
    obj = json.loads(out)
    assert len(obj["token_ids"]) == 8 and obj["finish_reason"] == "length"
    assert obj["prompt_token_ids"] and "Paris" in obj["text"]
    led = obj["ledger"]
    for key in ("weight_bytes_per_token", "kv_bytes_per_token", "prefill_tokens_per_s", "decode_tokens_per_s",
                "stage_seconds", "roofline_fraction"):
        assert key in led
    # default: SmolLM2's Q4_1 layers stay packed (int4) and its Q8_0 tied lm_head runs int8: ~95 MB per token
    assert 0.9e8 < led["weight_bytes_per_token"] < 1e8
    # the bf16 cache is read in place (prompt's one block as a view, decodes by the kernel): nothing copied — a
    # decode's blocks counted both as the kernel's reads and as view slots once made this negative
    assert led["bytes_per_token"]["kv_gather_bytes"] == 0


@pytest.mark.real_model
def test_generate_speculative_flags(capsys):
    base = ["generate", "--prompt", "Repeat: one two three four five six.", "--max-tokens", "12", "--temperature",
            "0", "--ignore-eos", "--json", "--dtype", "fp32"]
    plain = json.loads(run_cli(capsys, *base)[1])
    code, out, _ = run_cli(capsys, *base, "--speculative", "prompt_lookup", "--num-speculative-tokens", "3")
    assert code == 0 and json.loads(out)["token_ids"] == plain["token_ids"]
    code, _, err = run_cli(capsys, *base, "--speculative", "draft")
    assert_one_line_error(code, err, "needs an engine started with a draft model")


def test_models_listing(capsys):
    code, out, _ = run_cli(capsys, "models")
    assert code == 0 and "smollm2-135m" in out and "(default)" in out
    code, _, err = run_cli(capsys, "models", "install")
    assert_one_line_error(code, err, "needs an alias")


def test_trace_concurrency_below_one(capsys, tmp_path):
    code, _, err = run_cli(capsys, "trace", "--prompt", "hi", "--concurrency", "0", "--out", str(tmp_path))
    assert_one_line_error(code, err, "--concurrency must be at least 1")


@pytest.mark.real_model
def test_generate_logprobs(capsys):
    """--logprobs N: each token's logprob and its top N, in --json and (on stderr) in plain output."""
    base = ["generate", "--prompt", "The capital of France is", "--max-tokens", "3", "--temperature", "0",
            "--ignore-eos", "--logprobs", "2"]
    code, out, _ = run_cli(capsys, *base, "--json")
    obj = json.loads(out)
    assert code == 0 and [e["token_id"] for e in obj["logprobs"]] == obj["token_ids"]
    for e in obj["logprobs"]:
        assert len(e["top"]) == 2 and e["top"][0] == [e["token_id"], e["logprob"]] and e["logprob"] <= 0  # greedy
    code, _, err = run_cli(capsys, *base)
    assert code == 0 and err.count("[logprob]") == 3


def test_bad_decode_tail(capsys):
    code, _, err = run_cli(capsys, "eval", "ppl", "--window", "64", "--stride", "32", "--decode-tail", "64")
    assert_one_line_error(code, err, "--decode-tail must be >= 0 and < --window")


@pytest.mark.real_model
def test_eval_ppl_json_with_decode_tail(capsys):
    """Int8 KV read through decode steps: the same targets scored as by prefill, perplexity close to it."""
    base = ["eval", "ppl", "--max-tokens", "240", "--window", "80", "--stride", "40", "--json", "--kv-dtype", "int8",
            "--compile", "off"]
    code, out, _ = run_cli(capsys, *base)
    assert code == 0
    prefill = json.loads(out)
    code, out, _ = run_cli(capsys, *base, "--decode-tail", "24")
    assert code == 0
    decoded = json.loads(out)
    assert decoded["decode_tail"] == 24 and decoded["tokens"] == prefill["tokens"] == 3 * 79
    assert set(decoded["parts"]) == {"en", "zh", "code"}
    assert decoded["perplexity"] == pytest.approx(prefill["perplexity"], rel=0.05)


def test_boolean_sampling_flags_turn_both_ways():
    """Each boolean SamplingParams field has --flag and --no-flag: skip_special_tokens defaults to True."""
    from tokenhaul.cli import build_parser, sampling_params

    parse = build_parser().parse_args
    assert sampling_params(parse(["generate", "--prompt", "x"])).skip_special_tokens is True
    off = sampling_params(parse(["generate", "--prompt", "x", "--no-skip-special-tokens", "--ignore-eos"]))
    assert off.skip_special_tokens is False and off.ignore_eos is True


def test_logit_bias_flag_repeats():
    from tokenhaul.cli import build_parser, sampling_params

    parse = build_parser().parse_args
    assert sampling_params(parse(["generate", "--prompt", "x"])).logit_bias == {}
    args = parse(["generate", "--prompt", "x", "--logit-bias", "42=-100", "--logit-bias", "7=2.5"])
    assert sampling_params(args).logit_bias == {42: -100.0, 7: 2.5}


@pytest.mark.real_model
def test_generate_n_samples_and_prompt_logprobs(capsys):
    """--n 3 prints every sample (and lists them in --json); --prompt-logprobs gives one entry per prompt token."""
    base = ["generate", "--prompt", "The capital of France is", "--max-tokens", "3", "--temperature", "1",
            "--seed", "5", "--ignore-eos", "--n", "3", "--prompt-logprobs", "1"]
    code, out, _ = run_cli(capsys, *base, "--json")
    obj = json.loads(out)
    assert code == 0 and [o["index"] for o in obj["outputs"]] == [0, 1, 2]
    assert obj["outputs"][0]["token_ids"] == obj["token_ids"]
    pl = obj["prompt_logprobs"]
    assert len(pl) == len(obj["prompt_token_ids"]) and pl[0] is None
    assert [e["token_id"] for e in pl[1:]] == obj["prompt_token_ids"][1:] and all(len(e["top"]) == 1 for e in pl[1:])
    code, out, err = run_cli(capsys, *base)
    assert code == 0 and "[sample 2]" in out and "[sample 3]" in out
    assert err.count("[prompt logprob]") == len(pl) - 1


@pytest.mark.real_model
def test_generate_structured_outputs(capsys):
    """--structured-outputs JSON: StructuredOutputsParams' fields; the text is one of the choices."""
    code, out, _ = run_cli(capsys, "generate", "--prompt", "Is the sky blue? Answer:", "--max-tokens", "8",
                           "--temperature", "0", "--structured-outputs", '{"choice": ["yes", "no"]}', "--json")
    obj = json.loads(out)
    assert code == 0 and obj["text"] in ("yes", "no") and obj["finish_reason"] == "stop"


@pytest.mark.parametrize("flag,value,fragment", [
    ("--max-model-len", "-1", "max_model_len must be a positive number"),
    ("--num-kv-blocks", "-1", "num_kv_blocks must be a positive number"),
    ("--threads", "-3", "threads must be a positive number"),
    ("--kv-memory", "-1", "kv_memory_gib must be a positive number"),
])
def test_bad_engine_sizes(capsys, flag, value, fragment):
    code, _, err = run_cli(capsys, "generate", "--prompt", "Hi", "--max-tokens", "3", flag, value)
    assert_one_line_error(code, err, fragment)


@pytest.mark.real_model
def test_max_model_len_above_the_models_context(capsys):
    """Refused, naming both numbers, as vLLM does; not silently capped at the model's 8192."""
    code, _, err = run_cli(capsys, "generate", "--prompt", "Hi", "--max-tokens", "3", "--max-model-len", "100000")
    assert_one_line_error(code, err, "max_model_len 100000 exceeds the model's context of 8192 tokens")


@pytest.mark.parametrize("where", ["file", "/proc/nope/x"])
def test_trace_out_must_be_a_writable_directory(capsys, tmp_path, monkeypatch, where):
    """Checked before the model loads: LLM is never built."""
    import tokenhaul.llm

    monkeypatch.setattr(tokenhaul.llm, "LLM", lambda *a, **k: pytest.fail("the model was loaded"))
    out = tmp_path / "trace.json" if where == "file" else where
    if where == "file":
        out.write_text("{}")
    code, _, err = run_cli(capsys, "trace", "--prompt", "hi", "--out", str(out))
    assert_one_line_error(code, err, f"--out {out}: ")


def test_eval_ppl_stride_follows_the_window(monkeypatch):
    """Unset --stride is 256 (as before) but at most half the window, so --window 128 alone is valid and
    --window 1024 keeps its earlier figures."""
    from tokenhaul.cli import build_parser
    from tokenhaul.cli.eval_ppl import resolve_stride

    parse = build_parser().parse_args
    assert resolve_stride(parse(["eval", "ppl"])) == 256
    assert resolve_stride(parse(["eval", "ppl", "--window", "128"])) == 64
    assert resolve_stride(parse(["eval", "ppl", "--window", "1024"])) == 256
    assert resolve_stride(parse(["eval", "ppl", "--window", "128", "--stride", "128"])) == 128


def test_eval_ppl_bad_stride_is_named(capsys):
    code, _, err = run_cli(capsys, "eval", "ppl", "--window", "128", "--stride", "256")
    assert_one_line_error(code, err, "--stride")


@pytest.mark.parametrize("args,fragment", [
    (["--num-requests", "0"], "--num-requests must be at least 1, got 0"),
    (["--rate", "-1"], "--rate must be > 0 requests/s (default inf), got -1"),
    (["--rate", "0"], "--rate must be > 0"),
    (["--concurrency", "0"], "--concurrency must be at least 1, got 0"),
    (["--warmup", "-1"], "--warmup must be at least 0, got -1"),
])
def test_bench_serve_bad_arguments_before_connecting(capsys, args, fragment):
    code, _, err = run_cli(capsys, "bench", "serve", "--url", "http://127.0.0.1:1", *args)
    assert_one_line_error(code, err, fragment)
    assert "cannot reach" not in err


def test_token_id_flags_take_commas_or_repeats():
    """vLLM's comma form (--stop-token-ids 30,198) and the repeated flag, alone or mixed."""
    from tokenhaul.cli import build_parser, sampling_params

    parse = build_parser().parse_args
    assert sampling_params(parse(["generate", "--prompt", "x", "--stop-token-ids", "30,198"])).stop_token_ids == [
        30, 198]
    args = parse(["generate", "--prompt", "x", "--stop-token-ids", "30", "--stop-token-ids", "198,7"])
    assert sampling_params(args).stop_token_ids == [30, 198, 7]



class _Ran(Exception):
    pass


@pytest.mark.parametrize("concurrency, ran", [(1, ["long", "Hi"]), (3, ["long", "Hi", "long"])])
def test_trace_runs_every_prompt(capsys, tmp_path, monkeypatch, concurrency, ran):
    """Every --prompt runs: as many requests together as the larger of --concurrency and the prompts given,
    the prompts cycling when --concurrency is larger."""
    import tokenhaul.llm
    import tokenhaul.whatif.calibrate

    class FakeLLM:
        costs = dataclasses.make_dataclass("Costs", [("device", str, "cpu")])()

        def __init__(self, *a, **k):
            pass

        def generate(self, prompts, params):
            if prompts != "Warm up.":
                raise _Ran(prompts)

    monkeypatch.setattr(tokenhaul.llm, "LLM", FakeLLM)
    monkeypatch.setattr(tokenhaul.whatif.calibrate, "machine_roofline", lambda device: None)
    with pytest.raises(_Ran) as e:
        run_cli(capsys, "trace", "--prompt", "long", "--prompt", "Hi", "--concurrency", str(concurrency),
                "--out", str(tmp_path))
    assert e.value.args[0] == ran


@pytest.mark.parametrize("formats,storage,dtype,kv,want", [
    ((("int4", 120), ("int8", 1)), None, "bf16", torch.bfloat16, ("int4", "bf16")),  # SmolLM2's default
    ((("sparse", 121),), "int8", "bf16", torch.int8, ("int8", "int8")),  # --sparsity over int8 layers
    ((("sparse", 121),), "dense", "float32", torch.float32, ("fp32", "fp32")),  # over fp32 weights
    ((("dense", 121),), None, "bfloat16", torch.bfloat16, ("bf16", "bf16")),
])
def test_trace_run_options_are_whatif_names(tmp_path, formats, storage, dtype, kv, want):
    """run.json names what the what-if model takes (a sparse layer by the storage it wraps, a dense one by the
    compute dtype however it was spelled), so `whatif --replay` reads every trace's."""
    from tokenhaul.cli.trace import run_options
    from tokenhaul.config import engine_config
    from tokenhaul.whatif.workload import KV_BYTES, WEIGHT_BITS

    config = SimpleNamespace(torch_dtype=engine_config("x", dtype=dtype).torch_dtype, kv_torch_dtype=kv, sparsity=0.4)
    llm = SimpleNamespace(config=config, costs=SimpleNamespace(weight_formats=formats),
                          model=SimpleNamespace(layers=[SimpleNamespace(gate_up=SimpleNamespace(storage=storage))]),
                          files=SimpleNamespace(gguf_path=tmp_path / "m.gguf"))
    o = run_options(llm, "smollm2-135m")
    assert (o["quantization"], o["kv_dtype"]) == want and o["quantization"] in WEIGHT_BITS and o["kv_dtype"] in KV_BYTES
    assert run_options(llm, "m.gguf")["model"] == str(tmp_path / "m.gguf")  # a path: absolute, replayable elsewhere


def test_trace_of_a_server_leaves_no_earlier_run_options(tmp_path, monkeypatch):
    """trace --url writes a server's steps into --out: an earlier local trace's run.json there would give the
    replay that run's model and options, so it is removed."""
    import httpx

    from tokenhaul.cli.trace import trace_server

    (tmp_path / "run.json").write_text('{"model": "qwen2.5-coder-0.5b"}')
    led = {"replicas": {}, "routing": {}}
    monkeypatch.setattr(httpx, "get", lambda *a, **kw: SimpleNamespace(status_code=200, json=lambda: led))
    trace_server("http://x", tmp_path)
    assert (tmp_path / "steps.jsonl").exists() and not (tmp_path / "run.json").exists()


def _outputs(beams: bool, n: int) -> RequestOutput:
    """A finished request's output with n samples, or n beams."""
    outs = [CompletionOutput(k, f"text {k + 1}", [k], None, None, "length") for k in range(n)]
    out = RequestOutput("r", [1], [0], "text 1", finished=True, finish_reason="length", outputs=outs)
    if beams:
        out.beams = [BeamOutput([k], f"text {k + 1}", -0.5 * (k + 1), "length") for k in range(n)]
    return out


@pytest.mark.parametrize("beams", [False, True])
def test_generate_heads_every_output_when_there_are_several(capsys, beams):
    """--n 2 (samples) and --use-beam-search --n 2 print a header before each output, the first one too; one
    output prints its text alone."""
    from tokenhaul.cli.generate import print_outputs

    print_outputs(_outputs(beams, 2))
    head = ["[beam 1] score -0.5000", "[beam 2] score -1.0000"] if beams else \
        ["[sample 1] finish=length", "[sample 2] finish=length"]
    assert capsys.readouterr().out == f"{head[0]}\ntext 1\n\n{head[1]}\ntext 2\n"
    print_outputs(_outputs(beams, 1))
    assert capsys.readouterr().out == "text 1\n"


def test_models_list_names_only_known_models(capsys):
    """`models list ALIAS...` lists those models; an unknown alias is the one-line error `models install` gives
    (exit 2), not the whole catalog."""
    code, _, err = run_cli(capsys, "models", "list", "foo")
    assert_one_line_error(code, err, "unknown model 'foo'; known: smollm2-135m")
    code, _, err = run_cli(capsys, "models", "install", "foo")
    assert_one_line_error(code, err, "unknown model 'foo'; known: smollm2-135m")
    code, out, _ = run_cli(capsys, "models", "list", "smollm2-135m")
    assert code == 0 and out.splitlines()[0].startswith("smollm2-135m ") and len(out.splitlines()) == 1


def test_structured_outputs_params_import_from_the_package():
    """README's `SamplingParams(structured_outputs=StructuredOutputsParams(...))` imports both from tokenhaul, and
    the import stays torch-free."""
    import subprocess
    import sys

    code = ("import sys; from tokenhaul import SamplingParams, StructuredOutputsParams; "
            "p = SamplingParams(structured_outputs=StructuredOutputsParams(choice=['yes', 'no'])); "
            "print(p.structured_outputs.choice, 'torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.stdout.strip() == "['yes', 'no'] False", out.stderr


def test_help_lists_every_command():
    """`tokenhaul --help`'s description names every subcommand (eval ppl and calibrate-sparsity too), and each
    command with its own subcommands by them (bench serve)."""
    import argparse

    from tokenhaul.cli import build_parser

    parser = build_parser()
    listed = parser.description.removeprefix("tokenhaul command line: ").removesuffix(".").split(" | ")
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    assert {c.split()[0] for c in listed} == set(sub.choices)
    assert "bench serve" in listed and "eval ppl" in listed and "calibrate-sparsity" in listed


def test_whatif_plots_with_replay_is_refused_and_leaves_no_directory(capsys, tmp_path):
    """--replay draws nothing: --plots beside it is one line, and no directory is made for plots never drawn."""
    out = tmp_path / "a" / "plots"
    with pytest.raises(SystemExit) as e:
        main(["whatif", "--plots", str(out), "--replay", str(tmp_path / "steps.jsonl")])
    assert e.value.code == 2 and capsys.readouterr().err.count("\n") == 1 and not (tmp_path / "a").exists()


def test_whatif_plots_dir_is_made_only_by_a_run_that_gets_to_the_plots(capsys, tmp_path):
    """The directory is checked before any work but a run that fails (an unknown profile) leaves none behind."""
    out = tmp_path / "a" / "plots"
    with pytest.raises(SystemExit) as e:
        main(["whatif", "--hardware", "nope", "--plots", str(out)])
    assert e.value.code == 2 and "nope" in capsys.readouterr().err and not (tmp_path / "a").exists()
