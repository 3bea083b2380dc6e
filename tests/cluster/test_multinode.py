"""A multi-node Ray cluster on this machine: `ray start --head` and `ray start --address` as separate
process groups (1 CPU each), then `tokenhaul serve --replicas 2 --ray-address` joins it: one replica
per node, one OpenAI endpoint in front, and SIGTERM stops the server cleanly (the cluster stays)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

import httpx
import openai
import pytest
from raykit import RayNodes, free_port, kill_group
from serverkit import MODEL, wait_healthy

pytestmark = [pytest.mark.ray, pytest.mark.real_model]


def test_serve_joins_a_two_node_cluster(tmp_path, tokenizer):
    with RayNodes(2, cpus=1, log_dir=tmp_path) as nodes:
        port = free_port()
        log = open(tmp_path / "serve.log", "w")  # noqa: SIM115 (the server's whole life)
        cmd = [sys.executable, "-m", "tokenhaul.cli", "serve", "--model", MODEL, "--replicas", "2", "--threads", "1",
               "--ray-address", nodes.address, "--port", str(port), "--num-kv-blocks", "128",
               "--max-model-len", "512", "--log-level", "warning"]
        server = subprocess.Popen(cmd, env=nodes.env | {"PYTHONPATH": os.getcwd()}, stdout=log,
                                  stderr=subprocess.STDOUT, start_new_session=True)
        url = f"http://127.0.0.1:{port}"
        try:
            wait_healthy(server, url, 300, lambda: (tmp_path / "serve.log").read_text()[-3000:])
            health = httpx.get(url + "/health").json()["replicas"]
            nodes_used = {r["where"].split()[1] for r in health.values()}
            assert len(health) == 2 and len(nodes_used) == 2, health  # one replica on each Ray node
            print(json.dumps(health, indent=1))  # (seen with pytest -s)

            client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=120)
            served = set()
            for i in range(2):  # short prompts, nothing in flight: least loaded, ties alternate
                raw = client.completions.with_raw_response.create(model=MODEL, prompt=f"Count to {i + 3}:",
                                                                  max_tokens=6, temperature=0)
                served.add(raw.headers["x-tokenhaul-replica"])
                assert raw.parse().usage.completion_tokens == 6
            assert served == {"0", "1"}  # both nodes answered through the one endpoint
            print(httpx.get(url + "/metrics").text.count('replica="'), "series with a replica label;",
                  [ln for ln in httpx.get(url + "/metrics").text.splitlines() if ln.startswith("tokenhaul_routing")])

            server.send_signal(signal.SIGTERM)
            assert server.wait(60) == 0, (tmp_path / "serve.log").read_text()[-3000:]
        finally:
            if server.poll() is None:
                kill_group(server, signal.SIGKILL)
                server.wait(10)
        print((tmp_path / "serve.log").read_text()[-2000:])
