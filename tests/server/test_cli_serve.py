"""`tokenhaul serve` as a process (step loop in the main thread, HTTP in a thread), driven by
`tokenhaul bench serve`; SIGINT mid-stream ends the stream with an error event and the process."""

from __future__ import annotations

import json
import signal
import socket
import subprocess
import sys
import time

import httpx
import pytest

pytestmark = pytest.mark.real_model


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_serve_and_bench_cli():
    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    proc = subprocess.Popen([sys.executable, "-m", "tokenhaul.cli", "serve", "--model", "smollm2-135m", "--port",
                             str(port), "--threads", "2", "--num-kv-blocks", "128", "--log-level", "warning"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 120
        while True:
            assert proc.poll() is None, proc.stdout.read()
            try:
                if httpx.get(url + "/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, "server did not start"
            time.sleep(0.2)
        bench = subprocess.run([sys.executable, "-m", "tokenhaul.cli", "bench", "serve", "--url", url,
                                "--num-requests", "4", "--concurrency", "2", "--input-len", "8", "--output-len", "4",
                                "--slo-ttft-ms", "60000", "--json", "-"], capture_output=True, text=True, timeout=300)
        assert bench.returncode == 0, bench.stderr
        s = json.loads(bench.stdout)
        assert s["completed"] == 4 and s["output_tokens"] == 16 and s["goodput"] > 0
        with httpx.Client(timeout=60) as c, c.stream("POST", url + "/v1/completions", json={
                "prompt": "Once upon a time", "max_tokens": 500, "ignore_eos": True, "stream": True}) as r:
            lines = r.iter_lines()
            assert next(line for line in lines if line.startswith("data: {"))
            proc.send_signal(signal.SIGINT)
            rest = [line for line in lines if line.startswith("data: ")]
        assert rest[-1] == "data: [DONE]" and "engine stopped" in rest[-2]
        assert proc.wait(30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
