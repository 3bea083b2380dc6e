"""The profile of "this machine" is built for a device: every measurement here runs its device-generic
code on the CPU (tiny probes; the figures are not checked for speed, only for being measured), and a CUDA
profile without a GPU is refused in one line — by the library, `tokenhaul whatif` and bench/whatif_error.py."""

from __future__ import annotations

import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tokenhaul.errors import TokenhaulError
from tokenhaul.models.config import ModelConfig
from tokenhaul.whatif import calibrate as cal
from tokenhaul.whatif import clock, kernels, machine
from tokenhaul.whatif.hardware import THIS_MACHINE, THIS_MACHINE_CUDA, from_dict, load_hardware
from tokenhaul.whatif.workload import Workload, predict

ROOT = Path(__file__).resolve().parents[2]
no_gpu = pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without a GPU")


def _positive(x: float) -> bool:
    return math.isfinite(x) and x > 0


def test_best_seconds_warms_up_then_takes_the_best_of_repeats():
    calls = []
    t = clock.best_seconds(lambda: calls.append(1), "cpu", repeats=3, warmup=2)
    assert len(calls) == 5 and 0 <= t < 1


def test_profile_builder_measures_every_figure_on_the_cpu_device():
    entry = machine.measure_profile("cpu", machine.TINY)
    formats = machine.available_formats()
    assert entry["name"] == THIS_MACHINE and entry["device"] == "cpu" and "host_link" not in entry
    assert set(entry["kernel_bandwidth"]) == set(formats) and {"int8", "int4"} <= set(formats)
    assert set(entry["flops"]) == {"bf16", "fp32", "attention"} and set(entry["weight_only_flops"]) == {"int8", "int4"}
    rates = [*entry["flops"].values(), *entry["weight_only_flops"].values(), *entry["kernel_bandwidth"].values(),
             entry["gather_bandwidth"], entry["activation_bandwidth"]]
    assert all(_positive(r) for r in rates), entry
    assert [t["name"] for t in entry["tier"]] == ["L2", "L3", "DRAM"] and _positive(entry["tier"][-1]["bandwidth"])
    assert set(entry["overhead"]) == {"step_s", "layer_s", "group_s", "prefill_layer_s", "prefill_call_s",
                                      "gather_s", "token_s"}
    assert all(v >= 0 for v in entry["overhead"].values()) and _positive(sum(entry["overhead"].values()))
    hw = from_dict(entry, THIS_MACHINE)  # a profile the model runs on (the roofline: no linear curves)
    cfg = ModelConfig("llama", 64, 2, 4, 2, 16, 96, 97, 1024, 1e-5, 1e4, True)
    assert _positive(predict(Workload("tiny", cfg, batch=2, context=16, new_tokens=2), hw).tpot_s)


@pytest.mark.parametrize("fmt", ["bf16", "int8", "int4"])
def test_linear_curve_times_the_engine_kernel_on_the_device(fmt, tmp_path, monkeypatch):
    curve = kernels.measure_curve(fmt, 64, 32, "cpu", span=2e5, repeats=1, rows=(1, 4))
    switch = getattr(kernels.make_linear(fmt, torch.randn(64, 32)), "max_rows", None)
    assert [r for r, _ in curve] == sorted({1, 4} | ({switch, switch + 1} if switch else set()))
    assert all(_positive(s) for _, s in curve)
    monkeypatch.setattr(kernels, "measure_curve", lambda f, o, i, device, span: [(1, 1e-5), (8, 2e-5)])
    times = kernels.LinearTimes((fmt,), tmp_path, device="cpu")
    assert times(fmt, 64, 32, 4) == pytest.approx(1e-5 + 3 / 7 * 1e-5)
    key = f"{cal.machine_key('cpu')} | linear | {fmt} | 64x32 | kernels {kernels.kernels_version()}"
    assert cal.load_entry(key, tmp_path)["curve"] == [[1, 1e-5], [8, 2e-5]]  # a kernel change times it again
    monkeypatch.setattr(kernels, "measure_curve", lambda f, o, i, device, span: [(1, 2e-5), (8, 1e-5)])
    times.refresh()  # timed again: per row count the faster of the two passes, kept and stored
    assert times(fmt, 64, 32, 8) == pytest.approx(1e-5) and times(fmt, 64, 32, 1) == pytest.approx(1e-5)
    assert cal.load_entry(key, tmp_path)["curve"] == [[1, 1e-5], [8, 1e-5]]


def test_host_link_copies_both_ways():
    link = machine.host_link("cpu", 2**16, 1)  # on the CPU a memcpy; on a GPU host↔device over its bus
    assert set(link) == {"to_device", "to_host", "latency_s"} and all(_positive(v) for v in link.values())


def test_devices_that_cannot_be_measured_are_refused_in_one_line():
    clock.check_device("cpu")
    for bad in ("mps", "nonsense"):
        with pytest.raises(TokenhaulError):
            clock.check_device(bad)


@no_gpu
def test_cuda_profile_without_a_gpu_is_refused_in_one_line():
    for build in (lambda: machine.this_machine(device="cuda"), lambda: load_hardware(THIS_MACHINE_CUDA)):
        with pytest.raises(TokenhaulError, match="no CUDA GPU") as e:
            build()
        assert "\n" not in str(e.value)
    config = str(Path(__file__).parent / "llama-3-70b-config.json")
    r = subprocess.run([sys.executable, "-m", "tokenhaul.cli", "whatif", "--model", config, "--hardware",
                        THIS_MACHINE_CUDA], capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and r.stderr.startswith("error: ") and r.stderr.count("\n") == 1, r.stderr


@no_gpu
def test_whatif_error_bench_refuses_cuda_without_a_gpu_in_one_line():
    r = subprocess.run([sys.executable, str(ROOT / "bench" / "whatif_error.py"), "--device", "cuda"],
                       capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert r.returncode == 1 and r.stdout == "" and r.stderr.count("\n") == 1, r.stderr
    assert r.stderr.startswith("whatif_error: ") and "no CUDA GPU" in r.stderr
