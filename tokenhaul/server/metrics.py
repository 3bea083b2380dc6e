"""Prometheus metrics of the server: latencies seen by the front end, the last-mile cost per token,
and each engine replica's gauges and counters (label `replica`, read from the client's latest
snapshots at scrape time), plus the routing decisions when there are replicas to route over."""

from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from tokenhaul.engine.client import ReplicaState

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
_LATENCY = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0,
            2.5, 5.0, 10.0, 20.0, 40.0, 80.0)
_MICRO = (1e-6, 2.5e-6, 5e-6, 1e-5, 2.5e-5, 5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 1e-2)


class ServerMetrics:
    """One registry per server (so several apps can live in one process, as in the tests)."""

    def __init__(self, replicas: Callable[[], list[ReplicaState]],
                 routing: Callable[[], dict[str, int]] = dict) -> None:
        r = self.registry = CollectorRegistry()
        self.ttft = Histogram("tokenhaul_time_to_first_token_seconds",
                              "Arrival at the front end to the first token delivered to the request.",
                              buckets=_LATENCY, registry=r)
        self.itl = Histogram("tokenhaul_inter_token_latency_seconds",
                             "Time between consecutive token deliveries of one request.",
                             buckets=_LATENCY, registry=r)
        self.e2e = Histogram("tokenhaul_e2e_request_latency_seconds",
                             "Arrival at the front end to the last token of a finished request.",
                             buckets=_LATENCY + (160.0, 320.0), registry=r)
        self.last_mile = Histogram("tokenhaul_last_mile_seconds",
                                   "Front-end cost after the core: stage=detokenize (incremental "
                                   "detokenization and stop-string check, per engine delta) and "
                                   "stage=frame (JSON + SSE framing, per streamed chunk).",
                                   ["stage"], buckets=_MICRO, registry=r)
        self.prompt_tokens = Counter("tokenhaul_prompt_tokens", "Prompt tokens of admitted requests.",
                                     registry=r)
        self.generation_tokens = Counter("tokenhaul_generation_tokens",
                                         "Tokens generated and handed to the front end, those of every returned "
                                         "choice (as usage.completion_tokens; beam search: each of the n beams).",
                                         registry=r)
        self.requests = Counter("tokenhaul_requests", "Engine requests ended, by finish reason.",
                                ["finish_reason"], registry=r)
        self.rejected = Counter("tokenhaul_requests_rejected",
                                "API calls refused before reaching the engine, by reason.", ["reason"],
                                registry=r)
        r.register(_CoreCollector(replicas, routing))

    def render(self) -> bytes:
        return generate_latest(self.registry)


_ROUTING = {"affinity": "sent to a replica that was sent the same leading blocks",
            "spilled": "such a replica was over the load cap: sent to the least loaded",
            "unmatched": "no replica had its leading blocks: sent to the least loaded",
            "round_robin": "routing policy round_robin"}
_FAILOVER = {"retried": ("tokenhaul_requests_retried", "Requests moved to another replica after theirs failed "
                                                       "before streaming anything."),
             "replica_failures": ("tokenhaul_replica_failures", "Times a replica was seen to die.")}


class _CoreCollector(Collector):
    def __init__(self, replicas: Callable[[], list[ReplicaState]], routing: Callable[[], dict[str, int]]) -> None:
        self._replicas = replicas
        self._routing = routing

    def collect(self) -> Iterator[Metric]:
        reps = self._replicas()
        gauges = {
            "tokenhaul_replica_up": ("1 if the replica takes requests, 0 while it is down or restarting.",
                                     lambda r: float(r.up)),
            "tokenhaul_requests_running": ("Requests in the engine core's running batch.",
                                           lambda r: r.stats.num_running),
            "tokenhaul_requests_waiting": ("Requests in the engine core's waiting queue.",
                                           lambda r: r.stats.num_waiting),
            "tokenhaul_kv_blocks_used": ("KV blocks referenced by requests.", lambda r: r.stats.kv_blocks_used),
            "tokenhaul_kv_blocks_cached": ("KV blocks holding prefix-cache content.",
                                           lambda r: r.stats.kv_blocks_cached),
            "tokenhaul_kv_blocks_total": ("KV blocks in the pool.", lambda r: r.stats.kv_blocks_total),
            "tokenhaul_prefix_cache_hit_rate": (
                "Prompt tokens served from the prefix cache / prompt tokens looked up (since start).",
                lambda r: r.stats.prefix_hit_tokens / r.stats.prefix_query_tokens
                if r.stats.prefix_query_tokens else 0.0),
        }
        for name, (doc, value) in gauges.items():
            fam = GaugeMetricFamily(name, doc, labels=["replica"])
            for r in reps:
                fam.add_metric([r.name], value(r))
            yield fam
        counters = {
            "tokenhaul_prefix_cache_hit_tokens": ("Prompt tokens served from the prefix cache.",
                                                  lambda s: s.prefix_hit_tokens),
            "tokenhaul_prefix_cache_query_tokens": ("Prompt tokens looked up in the prefix cache.",
                                                    lambda s: s.prefix_query_tokens),
            "tokenhaul_preemptions": ("Requests preempted (recomputed later) for lack of KV blocks.",
                                      lambda s: s.num_preemptions),
            "tokenhaul_engine_steps": ("Engine core steps.", lambda s: s.num_steps),
            "tokenhaul_engine_step_seconds": ("Time spent inside EngineCore.step().", lambda s: s.step_seconds),
        }
        for name, (doc, value) in counters.items():
            fam = CounterMetricFamily(name, doc, labels=["replica"])
            for r in reps:
                fam.add_metric([r.name], value(r.stats))
            yield fam
        routing = self._routing()
        if routing:
            fam = CounterMetricFamily("tokenhaul_routing", "Routing decisions: " + "; ".join(
                f"{k}: {v}" for k, v in _ROUTING.items()) + ".", labels=["decision"])
            for k in _ROUTING:
                fam.add_metric([k], routing.get(k, 0))
            yield fam
            for k, (name, doc) in _FAILOVER.items():
                yield CounterMetricFamily(name, doc, value=routing.get(k, 0))
