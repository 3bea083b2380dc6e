"""The detached decode compile (`--compile auto`, engine/detached_compile.py) runs once per config across
processes: a run that exits while another process compiles the same step starts no second compile, and a
compile whose process died blocks nothing. No step is compiled here: the child's spawn and its engine are
stand-ins."""

from __future__ import annotations

import fcntl
import os
import subprocess
import sys

import pytest

from tokenhaul.config import EngineConfig
from tokenhaul.engine import detached_compile

POPEN = subprocess.Popen  # the real one (exit_of_a_run replaces it)


@pytest.fixture(autouse=True)
def cache_dir(tmp_path, monkeypatch):
    """A fresh inductor cache (where the compile's lock lives) and no real child process."""
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))
    return tmp_path / "inductor"


def exit_of_a_run(monkeypatch, config: EngineConfig, packages=()) -> list[list[str]]:
    """What one process running `config` eagerly starts at its exit: compile_after_exit's at-exit calls, run now
    as in a fresh process (no compile yet due); returns the command lines of the children it started."""
    started: list[list[str]] = []
    due: list = []
    monkeypatch.setattr(detached_compile.subprocess, "Popen", lambda args, **kw: started.append(list(args)))
    monkeypatch.setattr(detached_compile.atexit, "register", lambda f, *a, **kw: due.append((f, a, kw)))
    monkeypatch.setattr(detached_compile, "_after_exit", set())
    detached_compile.compile_after_exit(config, tuple(packages))
    for f, a, kw in due:
        f(*a, **kw)
    return started


def child_holding_the_lock(cfg: str) -> subprocess.Popen:
    """A stand-in for a running compile: another process that holds the config's lock until killed."""
    code = ("import fcntl, os, sys, time; fd = os.open(sys.argv[1], os.O_RDWR | os.O_CREAT); "
            "fcntl.flock(fd, fcntl.LOCK_EX); print('held', flush=True); time.sleep(60)")
    path = detached_compile.lock_path(cfg)
    path.parent.mkdir(parents=True, exist_ok=True)
    p = POPEN([sys.executable, "-c", code, str(path)], stdout=subprocess.PIPE, text=True)
    assert p.stdout.readline().strip() == "held"
    return p


def test_a_second_run_starts_no_compile_while_the_first_ones_runs(monkeypatch):
    """Two runs in a row (the first's compile still running when the second exits) start one compile, not two;
    once it has ended (its lock released), the next run's exit starts one again."""
    config = EngineConfig(model="smollm2-135m")
    first = exit_of_a_run(monkeypatch, config)
    assert len(first) == 1 and first[0][1:3] == ["-m", "tokenhaul.engine.detached_compile"]
    cfg = first[0][3]
    assert cfg == detached_compile.detached_config(config)
    child = child_holding_the_lock(cfg)
    try:
        assert exit_of_a_run(monkeypatch, config) == []
        other = exit_of_a_run(monkeypatch, EngineConfig(model="smollm2-135m", quantization="int8"))
        assert len(other) == 1  # another config's compile is not held back
    finally:
        child.kill()
        child.wait()
    assert len(exit_of_a_run(monkeypatch, config)) == 1


def test_a_dead_compiles_marker_blocks_nothing(monkeypatch):
    """A lock file left by a compile that died (its pid written, no process holding the lock) is no compile."""
    config = EngineConfig(model="smollm2-135m")
    path = detached_compile.lock_path(detached_compile.detached_config(config))
    path.parent.mkdir(parents=True)
    dead = POPEN([sys.executable, "-c", "pass"])
    dead.wait()
    path.write_text(f"{dead.pid}\n")
    assert len(exit_of_a_run(monkeypatch, config)) == 1


def test_no_compile_starts_once_the_step_is_saved(monkeypatch, tmp_path):
    """A step saved while this run went on (by another process's compile) is not compiled again at its exit,
    and the child is told which packages to look for."""
    config = EngineConfig(model="smollm2-135m")
    package = tmp_path / "tokenhaul-decode-0123-b1.pt2"
    started = exit_of_a_run(monkeypatch, config, [package])
    assert len(started) == 1 and started[0][4:] == [str(package)]
    package.write_bytes(b"saved")
    assert exit_of_a_run(monkeypatch, config, [package]) == []


def test_the_child_compiles_only_when_none_runs_and_none_is_saved(monkeypatch, tmp_path):
    """The detached process takes the config's lock before it loads anything: it leaves at once while another
    compile holds it, or when the packages it was told of are saved by now; else it starts the engine (which
    compiles) with the lock held, its pid in the lock file."""
    config = EngineConfig(model="smollm2-135m")
    cfg = detached_compile.detached_config(config)
    engines: list[dict] = []

    def engine(**kw):
        fd = os.open(detached_compile.lock_path(cfg), os.O_RDWR)
        with pytest.raises(BlockingIOError):  # held while it compiles
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        os.close(fd)
        assert detached_compile.lock_path(cfg).read_text().strip() == str(os.getpid())
        engines.append(kw)

    monkeypatch.setattr("tokenhaul.llm.LLM", engine)
    package = tmp_path / "tokenhaul-decode-0123-b1.pt2"
    child = child_holding_the_lock(cfg)
    try:
        detached_compile.main([cfg, str(package)])
        assert engines == []
    finally:
        child.kill()
        child.wait()
    detached_compile.main([cfg, str(package)])
    assert len(engines) == 1 and engines[0]["compile"] == "on" and engines[0]["model"] == "smollm2-135m"
    package.write_bytes(b"saved")
    detached_compile.main([cfg, str(package)])
    assert len(engines) == 1


def test_no_lock_file_possible_starts_no_compile_and_raises_nothing(monkeypatch, tmp_path):
    """A cache folder that cannot be made (here: below a plain file) starts no compile, and the exit of the run
    raises nothing (an at-exit traceback on every eager run before)."""
    blocker = tmp_path / "file"
    blocker.write_text("")
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(blocker / "inductor"))
    assert exit_of_a_run(monkeypatch, EngineConfig(model="smollm2-135m")) == []
