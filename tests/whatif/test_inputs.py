"""What the model reads: costs from a config alone (agreeing with the loaded model), transformers
config.json of a model not installed, the shipped hardware profiles, and the `whatif` command."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from tiny_models import tiny_model

from tokenhaul.ledger.costs import ModelCosts
from tokenhaul.whatif.hardware import THIS_MACHINE, THIS_MACHINE_CUDA, load_hardware, profile_names
from tokenhaul.whatif.modelspec import load_model_config

LLAMA70 = Path(__file__).parent / "llama-3-70b-config.json"


@pytest.mark.parametrize("arch", ["llama", "gemma3"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_from_config_agrees_with_from_model(arch, dtype):
    model = tiny_model(arch, dtype)
    size = dtype.itemsize
    assert ModelCosts.from_config(model.config, 8 * size, size, embed_itemsize=size) == \
        ModelCosts.from_model(model, size)


@pytest.mark.parametrize("quant, bits", [("int4", 5.0), ("int8", 8.0)])
def test_from_config_weight_bits_match_packed_layouts(quant, bits):
    """int4 group 32 with a bf16 scale and zero per group is exactly 5 bits per weight; int8 is 8 bits plus
    one bf16 scale per output row (from_config leaves those out: 2 bytes per row)."""
    from tokenhaul.layers.quantization import LinearFactory, QuantSpec

    make = LinearFactory(QuantSpec.parse(quant), torch.bfloat16)
    model = tiny_model(dtype=torch.bfloat16, make=make, vocab_size=128)
    packed = ModelCosts.from_model(model, 2)
    c = model.config
    cfg = ModelCosts.from_config(c, bits, 2)
    assert packed.packed and cfg.layer_params == packed.layer_params
    rows = c.num_layers * (c.q_size + 2 * c.kv_size + 2 * c.hidden_size + 2 * c.ffn_size)
    scales = 0 if quant == "int4" else 2
    assert packed.layer_weight_bytes == cfg.layer_weight_bytes + scales * rows
    assert packed.lm_head_bytes == cfg.lm_head_bytes + scales * c.vocab_size


def test_sparsity_and_kv_dtype_are_inputs():
    cfg = tiny_model().config
    dense, sparse = ModelCosts.from_config(cfg), ModelCosts.from_config(cfg, sparsity=0.5, kv_itemsize=1)
    ffn = 3 * cfg.hidden_size * cfg.ffn_size * cfg.num_layers
    assert dense.layer_params - sparse.layer_params == ffn // 2
    assert sparse.kv_bytes_per_token * 2 == dense.kv_bytes_per_token
    with pytest.raises(ValueError):
        ModelCosts.from_config(cfg, sparsity=1.0)


def test_llama3_70b_from_config_json():
    name, cfg = load_model_config(str(LLAMA70))
    mc = ModelCosts.from_config(cfg)
    params = mc.layer_params + mc.lm_head_params + cfg.vocab_size * cfg.hidden_size
    assert name == "meta-llama/Meta-Llama-3-70B" and cfg.num_kv_heads == 8 and not cfg.tie_embeddings
    assert params == pytest.approx(70.55e9, rel=0.001)  # the published 70.6 B, less norms
    assert mc.kv_bytes_per_token == 2 * 80 * 8 * 128 * 2


@pytest.mark.real_model
def test_from_config_agrees_with_real_model(smollm):
    _, cfg = load_model_config("smollm2-135m")  # GGUF metadata only
    assert ModelCosts.from_config(cfg, 32, 4, embed_itemsize=4) == smollm.costs


def test_every_profile_loads_with_sources():
    names = profile_names()
    assert names[:2] == [THIS_MACHINE, THIS_MACHINE_CUDA] and {"a100", "h100", "h200", "groq-lpu", "wafer-scale",
                                                                "mesh-3d-dram", "hbm-pim"} <= set(names)
    for n in names[2:]:
        hw = load_hardware(n)
        assert hw.tiers and hw.flops_for("bf16") > 0
        text = Path(hw.source).read_text()
        values = [ln for ln in text.splitlines() if "=" in ln and not ln.startswith(("#", "name", "description", "["))]
        assert all("#" in ln for ln in values), [ln for ln in values if "#" not in ln]  # every value cites a source
    assert load_hardware("hbm-pim").pim is not None


def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "tokenhaul.cli", "whatif", *args], capture_output=True, text=True,
                          timeout=120)


def test_whatif_json_and_compare(tmp_path):
    r = _cli("--model", str(LLAMA70), "--hardware", "h200", "--quantization", "int8", "--batch", "4",
             "--context", "4096", "--json")
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    for k in ("ttft_s", "tpot_s", "decode_tokens_per_s", "aggregate_tokens_per_s", "energy_j_per_token"):
        assert out[k] is not None and out[k] > 0
    assert out["bound"]["decode"].startswith("memory") and out["bound"]["prefill"] == "compute"
    assert out["aggregate_tokens_per_s"] == pytest.approx(4 * out["decode_tokens_per_s"])
    r = _cli("--model", str(LLAMA70), "--compare", "h100,groq-lpu,hbm-pim", "--quantization", "int8",
             "--plots", str(tmp_path))
    assert r.returncode == 0, r.stderr
    assert r.stdout.count("Is on-chip storage enough for the hot KV?") == 3 and "vs h100" in r.stdout
    assert sorted(p.name for p in tmp_path.glob("*.png")) == ["batch.png", "context.png", "roofline.png"]


def test_whatif_bad_input_is_one_line():
    for args in (("--hardware", "nope"), ("--quantization", "int3"), ("--model", str(LLAMA70), "--hardware", "a100")):
        r = _cli(*args)
        assert r.returncode == 2 and r.stderr.startswith("error: ") and r.stderr.count("\n") == 1, r.stderr


@pytest.mark.real_model
def test_trace_steps_replay_through_the_model(tmp_path):
    r = subprocess.run([sys.executable, "-m", "tokenhaul.cli", "trace", "--prompt", "Paging is", "--concurrency", "2",
                        "--max-tokens", "4", "--out", str(tmp_path)], capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr
    records = [json.loads(line) for line in (tmp_path / "steps.jsonl").read_text().splitlines()]
    assert len(records) >= 4 and all(r["chunks"] and r["stage_seconds"] for r in records)
    # the run's options beside the steps (SmolLM2's default: its GGUF's 4-bit blocks kept packed), taken by the
    # replay unless given
    assert json.loads((tmp_path / "run.json").read_text()) == {
        "model": "smollm2-135m", "quantization": "int4", "kv_dtype": "bf16", "sparsity": 0.0}
    r = _cli("--hardware", "h100", "--replay", str(tmp_path / "steps.jsonl"))
    assert r.returncode == 0, r.stderr
    assert "prefill: 1 steps" in r.stdout and "decode: 3 steps" in r.stdout
    assert "(smollm2-135m, int4 weights, bf16 KV, sparsity 0)" in r.stdout
    r = _cli("--hardware", "h100", "--quantization", "int8", "--replay", str(tmp_path / "steps.jsonl"))
    assert "(smollm2-135m, int8 weights, bf16 KV, sparsity 0)" in r.stdout


@pytest.mark.real_model
def test_gguf_without_vocab_key_takes_the_embedding_rows():
    """The what-if spec is the loader's config (one rule: models/gguf.py config_from_gguf)."""
    from tokenhaul.models.catalog import resolve
    from tokenhaul.models.gguf import load_gguf

    _, cfg = load_model_config("qwen2.5-coder-0.5b")  # its metadata has no qwen2.vocab_size
    assert cfg.vocab_size == 151936 and cfg.qkv_bias and not cfg.tie_embeddings
    loaded, tensors = load_gguf(resolve("qwen2.5-coder-0.5b").gguf_path)
    assert cfg == loaded and tensors["token_embd.weight"].shape[0] == 151936


def test_this_machine_profile_is_cached_and_remeasured_for_new_kernels(tmp_path, monkeypatch):
    from tokenhaul.whatif import machine

    calls = []
    entry = {"name": "this-machine", "flops": {f: 1e11 for f in machine.available_formats()} | {"attention": 5e10},
             "tier": [{"name": "DRAM", "capacity": 8e9, "bandwidth": 2e10}], "paged_kernel": "gather",
             "overhead": {"step_s": 1e-3, "layer_s": 1e-4}}
    monkeypatch.setattr(machine, "measure_profile", lambda device: calls.append(device) or dict(entry))
    hw = machine.this_machine(root=tmp_path)
    assert machine.this_machine(root=tmp_path) == hw and calls == ["cpu"]
    assert hw.name == THIS_MACHINE and hw.layer_overhead == 1e-4 and hw.paged_kernel == "gather"
    entry["flops"] = {"bf16": 1e11}  # cached before a packed kernel existed
    machine.this_machine(remeasure=True, root=tmp_path)
    full = dict(entry, flops=dict.fromkeys(machine.available_formats(), 1e11))
    monkeypatch.setattr(machine, "measure_profile", lambda device: calls.append(device) or full)
    machine.this_machine(root=tmp_path)
    assert len(calls) == 3


STEP = {"chunks": [["r0", 0, 4]], "sampled": ["r0"], "stage_seconds": {"forward": 0.01}, "kv_view_slots": 16}


@pytest.mark.parametrize("steps, run_json", [
    ("{}\n", None),  # no chunks
    ("[1, 2]\n", None),  # not an object
    (json.dumps({**STEP, "stage_seconds": {}}) + "\n", None),  # nothing measured
    (json.dumps({**STEP, "chunks": [["r0", 0]]}) + "\n", None),  # a chunk without its length
    (json.dumps({**STEP, "stage_seconds": {"forward": "x"}}) + "\n", None),
    ("not json\n", None),
    ("", None),  # no steps at all
    ("\n\n", None),
    (json.dumps(STEP) + "\n", "not json"),  # the run.json beside it
    (json.dumps(STEP) + "\n", "[1]"),
    (json.dumps(STEP) + "\n", '{"sparsity": "x"}'),
])
def test_replay_of_bad_records_is_one_line(tmp_path, capsys, steps, run_json):
    from tokenhaul.cli import main

    (tmp_path / "steps.jsonl").write_text(steps)
    if run_json is not None:
        (tmp_path / "run.json").write_text(run_json)
    with pytest.raises(SystemExit) as e:
        main(["whatif", "--hardware", "h100", "--replay", str(tmp_path / "steps.jsonl")])
    err = capsys.readouterr().err
    assert e.value.code == 2 and err.startswith("error: ") and err.count("\n") == 1, err


def test_replay_of_good_records(tmp_path, capsys):
    from tokenhaul.cli import main

    (tmp_path / "steps.jsonl").write_text(json.dumps(STEP) + "\n" + json.dumps(
        {**STEP, "chunks": [["r0", 4, 1]]}) + "\n")
    (tmp_path / "run.json").write_text('{"model": "smollm2-135m", "quantization": "int8"}')
    main(["whatif", "--hardware", "h100", "--replay", str(tmp_path / "steps.jsonl")])
    out = capsys.readouterr().out
    assert "replay of 2 steps" in out and "int8 weights" in out and "prefill: 1 steps" in out and "decode: 1" in out


@pytest.mark.parametrize("where", ["/proc/nope", "file"])
def test_plots_to_a_directory_that_cannot_be_made_is_one_line_before_any_work(tmp_path, capsys, where):
    from tokenhaul.cli import main

    (tmp_path / "file").write_text("")
    out = where if where.startswith("/") else str(tmp_path / where / "sub")
    with pytest.raises(SystemExit) as e:
        main(["whatif", "--hardware", "h100", "--plots", out])
    got = capsys.readouterr()
    assert e.value.code == 2 and got.out == "" and got.err.startswith("error: --plots ") and got.err.count("\n") == 1


def test_a_closed_pipe_exits_quietly():
    """`tokenhaul whatif | head -1`: the reader gone, whatif exits without a traceback."""
    import os

    r, w = os.pipe()
    os.close(r)
    try:
        p = subprocess.run([sys.executable, "-m", "tokenhaul.cli", "whatif", "--hardware", "h100"], stdout=w,
                           stderr=subprocess.PIPE, text=True, timeout=120)
    finally:
        os.close(w)
    assert p.returncode == 0 and p.stderr == "", p.stderr
