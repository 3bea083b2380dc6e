"""Ray test kit: a multi-node Ray cluster on this machine (each node its own `ray start` process
group, killed by its id at the end), and a way to run code on a server's event loop."""

from __future__ import annotations

import asyncio
import os
import secrets
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

RAY = str(Path(sys.executable).with_name("ray"))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class RayNodes:
    """`ray start --head` plus `ray start --address` workers, `cpus` CPUs each, as separate process
    groups; the environment (PYTHONPATH, a fresh auth token) is shared with whatever `env` starts."""

    def __init__(self, num_nodes: int, cpus: int, log_dir: Path) -> None:
        self.port = free_port()
        self.address = f"127.0.0.1:{self.port}"
        self.env = os.environ | {"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": secrets.token_hex(16),
                                 "OMP_WAIT_POLICY": "PASSIVE", "RAY_DISABLE_USAGE_STATS": "1",
                                 "RAY_memory_monitor_refresh_ms": "0"}  # as the pool's local instance
        self.num_nodes, self.cpus, self.log_dir = num_nodes, cpus, log_dir
        self.procs: list[subprocess.Popen] = []

    def _start(self, args: list[str], name: str) -> None:
        log = open(self.log_dir / f"{name}.log", "w")  # noqa: SIM115 (kept open for the process)
        self.procs.append(subprocess.Popen([RAY, "start", "--block", f"--num-cpus={self.cpus}", *args],
                                           env=self.env, stdout=log, stderr=subprocess.STDOUT,
                                           start_new_session=True))

    def __enter__(self) -> RayNodes:
        self._start(["--head", f"--port={self.port}", "--include-dashboard=false"], "head")
        self._wait_nodes(1)
        for i in range(1, self.num_nodes):
            self._start([f"--address={self.address}"], f"worker{i}")
        self._wait_nodes(self.num_nodes)
        return self

    def _wait_nodes(self, n: int, timeout: float = 120.0) -> None:
        code = (f"import ray; ray.init(address='{self.address}', logging_level='error'); "
                f"print(sum(x['Alive'] for x in ray.nodes()))")
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:  # ray.init can wait on an unreachable head forever: each probe has its own limit
                out = subprocess.run([sys.executable, "-c", code], env=self.env, capture_output=True, text=True,
                                     timeout=max(1.0, min(60.0, deadline - time.monotonic())))
            except subprocess.TimeoutExpired:
                continue
            if out.returncode == 0 and out.stdout.strip().splitlines()[-1:] == [str(n)]:
                return
            time.sleep(1.0)
        raise RuntimeError(f"{n} Ray nodes not up after {timeout} s; see {self.log_dir}")

    def __exit__(self, *exc: object) -> None:
        for p in reversed(self.procs):  # each node is its own process group: end it by its id
            kill_group(p, signal.SIGTERM)
        for p in reversed(self.procs):
            try:
                p.wait(3)
            except subprocess.TimeoutExpired:  # Ray drains up to 30 s on SIGTERM; do not wait for it
                kill_group(p, signal.SIGKILL)
                p.wait(10)


def kill_group(p: subprocess.Popen, sig: int) -> None:
    try:
        os.killpg(p.pid, sig)
    except ProcessLookupError:
        pass


def on_loop(loop: asyncio.AbstractEventLoop, fn: Callable[[], object], timeout: float = 30.0) -> object:
    """Run fn() on the server's event loop (in one turn of it) and return its result here."""

    async def call() -> object:
        return fn()

    return asyncio.run_coroutine_threadsafe(call(), loop).result(timeout)
