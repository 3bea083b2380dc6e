"""tokenhaul/native.py: a `lock` file left by a killed torch build must not make the next build wait forever."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.utils.cpp_extension

from tokenhaul import native


def test_stale_torch_lock_is_cleared_before_building(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    folder = native._build_dir("tokenhaul_probe")
    folder.mkdir(parents=True)
    (folder / "lock").touch()  # what a build killed mid-compile leaves behind
    seen = {}

    def fake_build(name, sources, build_directory, **kw):
        seen.update(name=name, lock=(Path(build_directory) / "lock").exists(), folder=build_directory)

    monkeypatch.setattr(torch.utils.cpp_extension, "load", fake_build)
    native._build("tokenhaul_probe", tmp_path / "probe.cpp", ["-O3"])
    assert seen == {"name": "tokenhaul_probe", "lock": False, "folder": str(folder)}
    assert folder.parent == tmp_path / folder.parent.name and "torch" in folder.parent.name
    assert folder.name.startswith("tokenhaul_probe-")  # and the checkout: another one builds its own


def test_builds_wait_for_each_other_through_the_flock(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """While another process holds the build's flock, a build does not start (it waits for the kernel's lock)."""
    import fcntl
    import subprocess
    import sys
    import time

    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    folder = native._build_dir("tokenhaul_probe")
    folder.mkdir(parents=True)
    guard = folder.with_name(folder.name + ".flock")
    holder = subprocess.Popen([sys.executable, "-c", f"import fcntl,sys,time; f=open({str(guard)!r},'w'); "
                               "fcntl.flock(f, fcntl.LOCK_EX); print('held', flush=True); time.sleep(2)"],
                              stdout=subprocess.PIPE, text=True)
    assert holder.stdout.readline().strip() == "held"
    started = []
    monkeypatch.setattr(torch.utils.cpp_extension, "load", lambda *a, **k: started.append(time.monotonic()))
    t0 = time.monotonic()
    native._build("tokenhaul_probe", tmp_path / "probe.cpp", ["-O3"])
    holder.wait(10)
    assert started and holder.returncode == 0
    with open(guard) as f:  # and the flock is free again once the build is done
        fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
    assert started[0] - t0 > 0.5


def test_int8_runs_per_thread_follow_the_cpu_vendor(monkeypatch: pytest.MonkeyPatch) -> None:
    """AMD builds stream 2 weight runs per thread, others 4; the flavour names it, so each has its own build."""
    from tokenhaul import host

    for vendor, streams in (("AuthenticAMD", 2), ("GenuineIntel", 4), ("", 4)):
        monkeypatch.setattr(host, "cpu_vendor", lambda v=vendor: v)
        flavour, flags = native._flags()
        assert f"-DSTREAMS={streams}" in flags and flavour.endswith(f"-s{streams}")


def test_shims_are_global_c_functions_of_their_ops() -> None:
    """Ops built with a C shim are offered to inductor (`custom_ops_to_c_shims`) and their functions resolve in
    the process's global namespace, where a compiled step's library looks them up."""
    import ctypes

    from tokenhaul.kv import decode_attention
    from tokenhaul.layers import bf16_gemv, int4_gemv, int8_gemv, linear_sparse

    sparse = linear_sparse.SparseLinear(torch.zeros(16, 16, dtype=torch.bfloat16), "dense", 0.5, 16, None)  # builds it
    if not (int4_gemv.available() and int8_gemv.available() and bf16_gemv.available() and decode_attention.available()
            and sparse.fused):
        pytest.skip("no C++ compiler")
    shims = native.c_shims()
    process = ctypes.CDLL(None)
    for op, name in ((torch.ops.tokenhaul_int4.gemv, "aoti_torch_cpu_gemv"),
                     (torch.ops.tokenhaul_int8.int8_gemv, "aoti_torch_cpu_int8_gemv"),
                     (torch.ops.tokenhaul_bf16.bf16_gemv, "aoti_torch_cpu_bf16_gemv"),
                     (torch.ops.tokenhaul_sparse.sparse_gemv, "aoti_torch_cpu_sparse_gemv"),
                     (torch.ops.tokenhaul_kv.decode_bf16, "aoti_torch_cpu_decode_bf16"),
                     (torch.ops.tokenhaul_kv.decode_int8, "aoti_torch_cpu_decode_int8")):
        assert f" {name}(" in shims[op.default][0]
        assert getattr(process, name)  # an AttributeError if the symbol is not global
