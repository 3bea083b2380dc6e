"""What Ray Serve adds per request over the plain actor call tokenhaul's ReplicaPool makes: a no-op
method called sequentially (a) on a plain Ray actor, (b) through a Ray Serve DeploymentHandle, (c)
over HTTP through Serve's proxy to the same deployment. Imports only ray (with the serve extra),
so it runs under a separate Python that has it (bench/scale_out.py --serve-python calls it).

Run: /tmp/serve-venv/bin/python bench/serve_hop.py [--calls 400]"""

from __future__ import annotations

import argparse
import asyncio
import socket
import statistics
import time
import urllib.request


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def row(name: str, ms: list[float]) -> str:
    q = statistics.quantiles(ms, n=100)
    return f"| {name} | {statistics.mean(ms):.2f} | {q[49]:.2f} | {q[98]:.2f} |"


async def timed(call, n: int) -> list[float]:
    for _ in range(20):  # warm-up: connections, first-call costs
        await call()
    out = []
    for _ in range(n):
        t0 = time.perf_counter()
        await call()
        out.append((time.perf_counter() - t0) * 1e3)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--calls", type=int, default=400)
    args = ap.parse_args()
    import logging

    import ray
    from ray import serve

    ray.init(address="local", num_cpus=2, include_dashboard=False, logging_level=logging.ERROR,
             _system_config={"memory_monitor_refresh_ms": 0})

    @ray.remote(num_cpus=0)
    class Echo:
        async def ping(self, x: int) -> int:
            return x

    @serve.deployment(ray_actor_options={"num_cpus": 0})
    class EchoDeployment:
        async def __call__(self, x) -> int:
            return 1

    port = free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port}, logging_config={"log_level": "ERROR"})
    handle = serve.run(EchoDeployment.bind(), route_prefix="/echo", logging_config={"log_level": "ERROR"})
    actor = Echo.remote()

    async def http() -> None:
        await asyncio.to_thread(lambda: urllib.request.urlopen(f"http://127.0.0.1:{port}/echo", timeout=30).read())

    async def go() -> list[list[float]]:
        return [await timed(lambda: actor.ping.remote(1), args.calls),
                await timed(lambda: handle.remote(1), args.calls),
                await timed(http, args.calls // 4)]

    a, h, p = asyncio.run(go())
    print("| path (no-op, sequential) | mean ms | p50 ms | p99 ms |\n|---|---|---|---|")
    print(row("plain actor call (what ReplicaPool makes)", a))
    print(row("Ray Serve DeploymentHandle call", h))
    print(row("HTTP through Ray Serve's proxy to the deployment", p))
    print(f"Serve handle - actor call: {statistics.median(h) - statistics.median(a):+.2f} ms per call (p50)")
    serve.shutdown()
    ray.shutdown()


if __name__ == "__main__":
    main()
