"""Scale out on Ray, measured at the engine-client seam (no HTTP, no tokenizer: the same AddRequests
go to every setup through the one EngineClient interface the server uses).

  1. Ray's cost per request: sequential 1-token requests, in-process core vs one Ray replica
     (2 threads each), the time outside the core's steps compared; and, with --serve-python (a
     Python with ray[serve]), a no-op Ray Serve handle call vs a plain actor call (bench/serve_hop.py).
  2. Same 2 cores, same KV memory: 1 replica x 2 threads (2K blocks) vs 2 replicas x 1 thread (K each).
  3. 2 replicas x 1 thread, cache-aware vs round-robin, on a workload whose shared prefixes do not
     all fit in one replica's KV cache (K blocks) but do fit when each replica keeps half of them.

Run: flock -x /tmp/tokenhaul-bench.lock python bench/scale_out.py [--serve-python /tmp/serve-venv/bin/python]"""

from __future__ import annotations

import argparse
import asyncio
import random
import statistics
import time
from dataclasses import dataclass

from tokenhaul.engine.client import EngineClient, InProcessClient
from tokenhaul.engine.messages import AddRequest, CoreOutputs
from tokenhaul.sampling_params import SamplingParams

MODEL = "smollm2-135m"
ENGINE = {"max_model_len": 2048, "max_num_seqs": 16}


@dataclass
class Run:
    name: str
    ttft: list[float]
    e2e_s: float
    out_tokens: int
    hit_rate: float
    per_replica: dict[str, int]
    steps: int  # engine steps, all replicas: each reads every weight once
    computed: int  # prompt tokens the engines computed (the ledgers': cache hits excluded)
    duplicate_mb: float  # KV of prefix tokens computed on a second replica (router's view)
    routing: str  # routing decisions during the run

    def row(self) -> str:
        q = statistics.quantiles(self.ttft, n=100)
        spread = " / ".join(f"{n}:{c}" for n, c in sorted(self.per_replica.items()))
        return (f"| {self.name} | {self.out_tokens / self.e2e_s:.1f} | {q[49] * 1000:.0f} | {q[98] * 1000:.0f} | "
                f"{self.hit_rate:.0%} | {self.computed} | {self.duplicate_mb:.1f} | {self.steps} | {spread} | "
                f"{self.routing} |")


def workload(n: int, groups: int, prefix_len: int, suffix_len: int, seed: int = 0) -> list[list[int]]:
    """n prompts: one of `groups` shared prefixes (a long system prompt) + a distinct suffix each."""
    rng = random.Random(seed)
    prefixes = [[rng.randrange(100, 40000) for _ in range(prefix_len)] for _ in range(groups)]
    order = [i % groups for i in range(n)]
    rng.shuffle(order)  # arrivals interleave the groups at random, as users do
    return [prefixes[g] + [rng.randrange(100, 40000) for _ in range(suffix_len)] for g in order]


class Driver:
    """Feeds AddRequests to a started client and times them (TTFT, end to end) on its event loop."""

    def __init__(self, client: EngineClient) -> None:
        self.client = client
        self.first: dict[str, float] = {}
        self.done: dict[str, asyncio.Future] = {}
        self.tokens = 0

    async def __aenter__(self) -> Driver:
        await self.client.start(self._on_outputs)
        return self

    async def __aexit__(self, *exc: object) -> None:
        await asyncio.to_thread(self.client.close)

    def _on_outputs(self, out: CoreOutputs) -> None:
        now = time.perf_counter()
        for d in out.deltas:
            self.first.setdefault(d.request_id, now)
            self.tokens += len(d.new_token_ids)
            if d.finished:
                self.done[d.request_id].set_result(None)
        for rid, why in out.failed:
            self.done[rid].set_exception(RuntimeError(why))

    async def run(self, prompts: list[list[int]], params: SamplingParams, concurrency: int,
                  tag: str) -> tuple[list[float], float, int, dict[str, int]]:
        """Closed loop, `concurrency` in flight. Returns (TTFTs, seconds, output tokens, requests per replica)."""
        sem = asyncio.Semaphore(concurrency)
        ttft: list[float] = []
        per: dict[str, int] = {}
        tokens0 = self.tokens

        async def one(i: int, p: list[int]) -> None:
            async with sem:
                rid = f"{tag}-{i}"
                self.done[rid] = asyncio.get_running_loop().create_future()
                t0 = time.perf_counter()
                name = self.client.add(AddRequest(rid, p, params))
                per[name] = per.get(name, 0) + 1
                await self.done[rid]
                ttft.append(self.first[rid] - t0)

        t0 = time.perf_counter()
        await asyncio.gather(*(one(i, p) for i, p in enumerate(prompts)))
        return ttft, time.perf_counter() - t0, self.tokens - tokens0, per


def hit_rate(client: EngineClient, before: dict) -> float:
    hit = sum(r.stats.prefix_hit_tokens - before[r.name][0] for r in client.replicas())
    query = sum(r.stats.prefix_query_tokens - before[r.name][1] for r in client.replicas())
    return hit / query if query else 0.0


async def computed(client: EngineClient) -> tuple[int, int]:
    """(prompt tokens computed by all replicas, KV bytes per token) from their ledgers."""
    snaps = (await client.ledgers()).values()
    return sum(s["prompt_tokens_computed"] for s in snaps), max(s["kv_bytes_per_token"] for s in snaps)


async def measure(d: Driver, name: str, prompts, params, concurrency: int) -> Run:
    client = d.client
    await d.run(workload(2, 2, 32, 8, seed=99), SamplingParams(max_tokens=2, temperature=0), 2, "warm")
    await asyncio.sleep(1.2)  # a fresh stats snapshot from every replica (polls return at least every 1 s)
    before = {r.name: (r.stats.prefix_hit_tokens, r.stats.prefix_query_tokens) for r in client.replicas()}
    steps0, routed0, (computed0, _) = (sum(r.stats.num_steps for r in client.replicas()), client.routing(),
                                       await computed(client))
    ttft, secs, toks, per = await d.run(prompts, params, concurrency, name)
    await asyncio.sleep(1.2)
    steps = sum(r.stats.num_steps for r in client.replicas()) - steps0
    routed = {k: v - routed0[k] for k, v in client.routing().items() if v - routed0[k]}
    computed1, kv_per_token = await computed(client)
    dup = routed.pop("duplicate_prefix_tokens", 0)
    return Run(name, ttft, secs, toks, hit_rate(client, before), per, steps, computed1 - computed0,
               dup * kv_per_token / 1e6, " ".join(f"{k} {v}" for k, v in routed.items()) or "-")


def step_seconds(client: EngineClient) -> float:
    return sum(r.stats.step_seconds for r in client.replicas())


async def latency(d: Driver, n: int) -> tuple[float, float]:
    """Sequential 1-token requests (8-token prompts): mean ms per request, in all and inside the
    core's steps. The difference is what the path around the core costs; steps vary with load."""
    params = SamplingParams(max_tokens=1, temperature=0)
    await d.run(workload(3, 3, 8, 0, seed=7), params, 1, "warm-lat")
    await asyncio.sleep(1.2)
    s0, t0 = step_seconds(d.client), time.perf_counter()
    await d.run(workload(n, n, 8, 0, seed=3), params, 1, "lat")
    wall = time.perf_counter() - t0
    await asyncio.sleep(1.2)  # the replicas' last stats (with the last step's time) come with a poll
    return wall / n * 1000, (step_seconds(d.client) - s0) / n * 1000


async def in_process_latency(n: int, blocks: int) -> tuple[float, float]:
    async with Driver(in_process(2, blocks)) as d:
        return await latency(d, n)


async def one_replica(args, prompts, params) -> tuple[tuple[float, float], Run]:
    """1 replica x 2 threads, with both replicas' KV memory: the per-request latency, then the load."""
    async with Driver(pool(1, 2, 2 * args.kv_blocks)) as d:
        return (await latency(d, args.latency_requests),
                await measure(d, "1 replica x 2 threads", prompts, params, args.concurrency))


async def two_replicas(args, prompts, other_prompts, params) -> list[Run]:
    """2 replicas x 1 thread: cache-aware, then round-robin on a workload of the same shape with
    other prefixes (so the first run's cache cannot help the second)."""
    async with Driver(pool(2, 1, args.kv_blocks)) as d:
        ca = await measure(d, "2 replicas x 1 thread, cache-aware", prompts, params, args.concurrency)
        d.client.router.policy = "round_robin"
        rr = await measure(d, "2 replicas x 1 thread, round-robin", other_prompts, params, args.concurrency)
    return [ca, rr]


def in_process(threads: int, blocks: int) -> InProcessClient:
    import torch

    from tokenhaul.ledger.core_ledger import CoreLedger
    from tokenhaul.llm import LLM

    torch.set_num_threads(threads)
    llm = LLM(MODEL, threads=threads, num_kv_blocks=blocks, **ENGINE)
    return InProcessClient(llm.core, CoreLedger(llm.costs))  # as `tokenhaul serve` builds it


def pool(replicas: int, threads: int, blocks: int):
    from tokenhaul.cluster.pool import ReplicaPool

    return ReplicaPool(MODEL, replicas, ENGINE | {"threads": threads, "num_kv_blocks": blocks})


def serve_hop(python: str, n: int) -> str:
    """bench/serve_hop.py under a Python that has ray[serve] (kept out of tokenhaul's environment)."""
    import subprocess
    from pathlib import Path

    script = Path(__file__).with_name("serve_hop.py")
    out = subprocess.run([python, str(script), "--calls", str(n)], capture_output=True, text=True, timeout=300)
    if out.returncode != 0:
        return f"serve_hop.py failed: {out.stderr.strip()[-500:]}"
    return "\n".join(ln for ln in out.stdout.splitlines() if ln.startswith(("|", "Serve")))  # not Ray's log lines


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, default=48)
    ap.add_argument("--concurrency", type=int, default=6)
    ap.add_argument("--groups", type=int, default=4, help="distinct shared prefixes")
    ap.add_argument("--prefix-len", type=int, default=512)
    ap.add_argument("--suffix-len", type=int, default=32)
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--kv-blocks", type=int, default=96, help="KV blocks (of 16 tokens) per 1-thread replica")
    ap.add_argument("--latency-requests", type=int, default=40)
    ap.add_argument("--serve-python", default=None, help="a Python with ray[serve] installed, for the Serve hop")
    args = ap.parse_args()
    import ray

    ray.init(address="local", num_cpus=2, include_dashboard=False, logging_level="warning",
             _system_config={"memory_monitor_refresh_ms": 0})  # as ReplicaPool's own local instance
    prompts = workload(args.requests, args.groups, args.prefix_len, args.suffix_len)
    other = workload(args.requests, args.groups, args.prefix_len, args.suffix_len, seed=1)
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0, ignore_eos=True)

    print(f"(started {time.strftime('%H:%M:%S')})", flush=True)
    local = asyncio.run(in_process_latency(args.latency_requests, 2 * args.kv_blocks))
    remote, run1 = asyncio.run(one_replica(args, prompts, params))
    runs = [run1, *asyncio.run(two_replicas(args, prompts, other, params))]
    print("\n## Ray's cost per request (sequential 1-token requests, 8-token prompts, 2 threads)\n")
    print("| setup | ms / request | in core steps | outside the steps |\n|---|---|---|---|")
    for name, (wall, step) in (("in-process core (thread)", local), ("1 Ray replica (actor)", remote)):
        print(f"| {name} | {wall:.2f} | {step:.2f} | {wall - step:.2f} |")
    cost = (remote[0] - remote[1]) - (local[0] - local[1])
    print(f"| **Ray's cost (difference outside the steps)** | | | **{cost:.2f}** |")
    if args.serve_python:
        print("\n## Ray Serve handle vs plain actor call (no-op method, sequential)\n")
        print(serve_hop(args.serve_python, 400))

    print(f"\n## {args.requests} requests, {args.concurrency} in flight, {args.groups} shared prefixes of "
          f"{args.prefix_len} tokens + {args.suffix_len} distinct, {args.max_tokens} new tokens, greedy; "
          f"KV {args.kv_blocks} blocks of 16 per 1-thread replica, {2 * args.kv_blocks} for the 2-thread one\n")
    print("| setup | out tok/s | TTFT p50 ms | TTFT p99 ms | prefix hit rate | prompt tokens computed "
          "| MB KV computed twice | engine steps | requests per replica | routing |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in runs:
        print(r.row())
    ray.shutdown()


if __name__ == "__main__":
    main()
