"""`tokenhaul serve` as a process (step loop in the main thread, HTTP in a thread), driven by
`tokenhaul bench serve`; SIGTERM mid-stream drains: streams finish, new requests get 503, exit 0."""

from __future__ import annotations

import contextlib
import json
import signal
import socket
import subprocess
import sys
import time

import httpx
import pytest
from serverkit import wait_healthy

pytestmark = pytest.mark.real_model


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_serve_and_bench_cli():
    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    proc = subprocess.Popen([sys.executable, "-m", "tokenhaul.cli", "serve", "--model", "smollm2-135m", "--port",
                             str(port), "--threads", "2", "--num-kv-blocks", "128", "--log-level", "warning",
                             "--shutdown-timeout", "600"],  # a loaded CI machine may decode slowly: drain, not race
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        wait_healthy(proc, url, 300, proc.stdout.read)  # a start that builds the C++ ops on busy cores: minutes
        bench = subprocess.run([sys.executable, "-m", "tokenhaul.cli", "bench", "serve", "--url", url,
                                "--num-requests", "4", "--concurrency", "2", "--input-len", "8", "--output-len", "4",
                                "--slo-ttft-ms", "60000", "--json", "-"], capture_output=True, text=True, timeout=300)
        assert bench.returncode == 0, bench.stderr
        s = json.loads(bench.stdout)
        assert s["completed"] == 4 and s["output_tokens"] == 16 and s["goodput"] > 0
        led = s["ledger"]["per_replica"]["0"]  # the in-process core keeps a ledger too, read by bench serve
        assert led["engine_steps"] > 0 and led["prompt_tokens_computed"] > 0 and led["prefix_miss"]["kv_bytes"] > 0
        drain_with_streams_in_flight(proc, url)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def drain_with_streams_in_flight(proc: subprocess.Popen, url: str) -> None:
    """SIGTERM with three streams in flight: /health and new requests get 503, every stream runs to
    its end ([DONE], finish_reason "length"), and the process exits with status 0."""
    body = {"prompt": "Once upon a time", "max_tokens": 64, "ignore_eos": True, "stream": True}
    with httpx.Client(timeout=120) as c, contextlib.ExitStack() as stack:
        lines = []
        for _ in range(3):
            it = stack.enter_context(c.stream("POST", url + "/v1/completions", json=body)).iter_lines()
            assert next(ln for ln in it if ln.startswith("data: {"))
            lines.append(it)
        proc.send_signal(signal.SIGTERM)
        while c.get(url + "/health").status_code != 503:
            time.sleep(0.02)
        refused = c.post(url + "/v1/completions", json={"prompt": "Hi", "max_tokens": 2})
        assert refused.status_code == 503 and refused.json()["error"]["code"] == "engine_unavailable"
        for it in lines:
            rest = [ln for ln in it if ln.startswith("data: ")]
            assert rest[-1] == "data: [DONE]" and json.loads(rest[-2][6:])["choices"][0]["finish_reason"] == "length"
    assert proc.wait(600) == 0, proc.stdout.read()
