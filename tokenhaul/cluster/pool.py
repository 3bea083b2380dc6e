"""ReplicaPool: the EngineClient over N engine replicas, each a Ray actor with its own threads and
KV cache, on one machine or many. It routes each request (`Router`), long-polls every replica for
outputs, and when a replica dies it retries elsewhere the requests that had streamed nothing yet,
fails the others cleanly, and waits for Ray to restart it.

    front end ──add──► Router ──submit([adds], [aborts])──► replica actor i ──► EngineCore
        ▲                                                        │
        └──────────── on_outputs ◄── poll() (one round trip per batch of steps) ┘"""

from __future__ import annotations

import asyncio
import logging
import socket
import threading
import time
from dataclasses import dataclass

from tokenhaul.cluster.replica import EngineReplica, ReplicaInfo
from tokenhaul.cluster.router import NoReplica, Router
from tokenhaul.engine.client import EngineClient, OnOutputs, ReplicaState
from tokenhaul.engine.messages import AbortRequest, AddRequest, CoreOutputs, CoreStats
from tokenhaul.errors import TokenhaulError

log = logging.getLogger("tokenhaul.cluster")
POLL_TIMEOUT = 1.0  # s a poll waits for outputs: also how stale an idle replica's stats may be


def import_ray():
    try:
        import ray
    except ImportError:
        raise TokenhaulError("--replicas runs engine replicas on Ray, which is not installed: "
                             "pip install 'tokenhaul[ray]'") from None
    return ray


def _check_reachable(address: str | None, timeout: float = 5.0) -> None:
    """Fail at once, in one line, where `address` is a host:port nothing answers at (ray.init would retry for
    minutes); "auto", ray:// and other forms are left to Ray."""
    host, _, port = (address or "").rpartition(":")
    if not host or not port.isdigit() or "/" in host:
        return
    try:
        socket.create_connection((host.strip("[]"), int(port)), timeout=timeout).close()
    except OSError as e:
        raise TokenhaulError(f"cannot reach the Ray cluster at --ray-address {address}: {e}") from None


@dataclass
class _Track:
    """A request the pool has sent and not seen end."""

    msg: AddRequest
    replica: str
    streamed: bool = False  # a delta reached the front end: it cannot be replayed elsewhere
    retries: int = 0


class ReplicaPool(EngineClient):
    """Start `replicas` actors of `model` (blocking until every one has loaded it). Without
    `address` a local Ray instance is started and shut down with the pool; with one, the pool joins
    that cluster and spreads the replicas over its nodes."""

    moves_requests = True  # a request whose replica dies before it streamed is retried on another
    def __init__(self, model: str, replicas: int, engine_kwargs: dict | None = None, address: str | None = None,
                 policy: str = "cache_aware", load_cap: int = 4, max_restarts: int = 10, max_retries: int = 1) -> None:
        ray = import_ray()
        if replicas < 1:
            raise TokenhaulError(f"--replicas must be at least 1, got {replicas}")
        kwargs = dict(engine_kwargs or {})
        threads = kwargs.get("threads") or 1
        kwargs["threads"] = threads
        self._stopped = threading.Event()
        self._stop_lock = threading.Lock()
        self._own_ray = not ray.is_initialized()
        if self._own_ray:
            _check_reachable(address)
            # a local instance: CPUs for the replicas, and no Ray OOM killer (on a crowded node it picks the
            # youngest workers, the replicas loading their model, whoever holds the memory; the kernel's stays)
            local = {} if address else {"num_cpus": replicas * threads,
                                        "_system_config": {"memory_monitor_refresh_ms": 0}}
            # the workers inherit this environment (PYTHONPATH, OMP_WAIT_POLICY) through the raylet
            ray.init(address=address or "local", include_dashboard=False, logging_level=logging.WARNING, **local)
        self.max_retries = max_retries
        actor = ray.remote(EngineReplica).options(num_cpus=threads, max_restarts=max_restarts,
                                                  scheduling_strategy="SPREAD")
        self.names = [str(i) for i in range(replicas)]
        self._actors = {n: actor.remote(n, model, kwargs) for n in self.names}
        try:
            infos = [self._first_ready(ray, a) for a in self._actors.values()]
        except Exception as e:
            self._stop_ray()
            raise TokenhaulError(f"an engine replica did not start: {e}") from None
        self._info: dict[str, ReplicaInfo] = {i.name: i for i in infos}
        self.limits = infos[0].limits
        self.router = Router(self.names, self.limits.block_size, policy, load_cap)
        self._up = dict.fromkeys(self.names, True)
        self._stats = {n: CoreStats(kv_blocks_total=self.limits.num_blocks) for n in self.names}
        self._tracks: dict[str, _Track] = {}
        self._out_adds: dict[str, list[AddRequest]] = {n: [] for n in self.names}
        self._out_aborts: dict[str, list[AbortRequest]] = {n: [] for n in self.names}
        self._flush_scheduled = False
        self.num_retried = 0
        self.num_replica_failures = 0
        self._loop: asyncio.AbstractEventLoop | None = None
        self._on_outputs: OnOutputs | None = None
        self._tasks: list[asyncio.Task] = []
        self._closing = False

    @staticmethod
    def _first_ready(ray, actor, timeout: float = 600.0) -> ReplicaInfo:
        """Wait for a replica's model; a restart meanwhile (a crash, an OOM kill) is waited out."""
        deadline = time.monotonic() + timeout
        while True:
            try:
                return ray.get(actor.ready.remote())
            except ray.exceptions.ActorUnavailableError:  # restarting: calls fail at once until it is back
                if time.monotonic() > deadline:
                    raise
                time.sleep(1.0)

    # EngineClient ------------------------------------------------------------------------------
    async def start(self, on_outputs: OnOutputs, start_core: bool = True) -> None:
        self._loop, self._on_outputs = asyncio.get_running_loop(), on_outputs
        self._tasks = [self._loop.create_task(self._poll_loop(n)) for n in self.names]

    def add(self, msg: AddRequest) -> str:
        name = self.router.route(msg.prompt_token_ids)
        self._tracks[msg.request_id] = _Track(msg, name)
        self._send(name, add=msg)
        return name

    def abort(self, request_id: str, reason: str = "abort") -> None:
        t = self._tracks.pop(request_id, None)
        if t is not None:
            self.router.finish(t.replica)
            self._send(t.replica, abort=AbortRequest(request_id, reason))

    @property
    def alive(self) -> bool:
        return not self._closing and any(self._up.values())

    def replicas(self) -> list[ReplicaState]:
        return [ReplicaState(n, self._up[n], self._stats[n], self._where(n))
                for n in self.names]

    def routing(self) -> dict[str, int]:
        c = self.router.counts
        return {"affinity": c.affinity, "spilled": c.spilled, "unmatched": c.unmatched,
                "round_robin": c.round_robin, "retried": self.num_retried,
                "replica_failures": self.num_replica_failures,
                "duplicate_prefix_tokens": c.duplicate_tokens}

    async def ledgers(self, since: int | None = None) -> dict[str, dict]:
        ray = import_ray()
        up = [n for n in self.names if self._up[n]]
        snaps = await asyncio.gather(*(self._actors[n].ledger.remote(since) for n in up), return_exceptions=True)
        out = {}
        for n, s in zip(up, snaps, strict=True):
            if isinstance(s, ray.exceptions.RayError):  # died meanwhile: its ledger died with it
                continue
            if isinstance(s, BaseException):
                raise s
            out[n] = s | {"where": self._where(n)}
        return out

    def _where(self, name: str) -> str:
        i = self._info[name]
        return f"node {i.node_id[:12]} ({i.node_ip}) pid {i.pid}, {i.threads} threads"

    def run(self) -> None:
        self._stopped.wait()

    def close(self) -> None:
        self._closing = True
        loop = self._loop
        if loop is not None and not loop.is_closed():
            for t in self._tasks:
                loop.call_soon_threadsafe(t.cancel)
        self._stop_ray()

    def _stop_ray(self) -> None:
        with self._stop_lock:
            if self._stopped.is_set():
                return
            ray = import_ray()
            for a in getattr(self, "_actors", {}).values():
                try:
                    ray.kill(a, no_restart=True)
                except Exception:  # already gone
                    pass
            if self._own_ray:
                ray.shutdown()
            self._stopped.set()

    def kill(self, name: str) -> None:
        """Kill one replica's process as a crash would (Ray restarts it); for tests and drills. Its
        requests are moved or failed at once, as if its death had been seen."""
        self._replica_down(name, "killed")
        import_ray().kill(self._actors[name], no_restart=False)

    # sending: one submit() per replica per event-loop turn ------------------------------------
    def _send(self, name: str, add: AddRequest | None = None, abort: AbortRequest | None = None) -> None:
        if add is not None:
            self._out_adds[name].append(add)
        if abort is not None:
            self._out_aborts[name].append(abort)
        if not self._flush_scheduled:
            self._flush_scheduled = True
            self._loop.call_soon(self._flush)

    def _flush(self) -> None:
        self._flush_scheduled = False
        for n in self.names:
            adds, aborts = self._out_adds[n], self._out_aborts[n]
            if (adds or aborts) and self._up[n]:
                self._actors[n].submit.remote(adds, aborts)
            self._out_adds[n], self._out_aborts[n] = [], []

    # receiving ---------------------------------------------------------------------------------
    async def _poll_loop(self, name: str) -> None:
        ray = import_ray()
        actor = self._actors[name]
        while not self._closing:
            try:
                outs, stats = await actor.poll.remote(POLL_TIMEOUT)
            except ray.exceptions.RayError as e:
                if self._closing:
                    return
                self._replica_down(name, f"{type(e).__name__}")
                await self._await_restart(name)
                continue
            self._stats[name] = stats
            for out in outs:
                try:
                    self._deliver(name, out)
                except Exception:  # a front-end bug must not silence this replica's outputs for good
                    log.exception("replica %s: outputs of step %d not delivered", name, out.step)

    def _deliver(self, name: str, out: CoreOutputs) -> None:
        """Pass a replica's outputs on, dropping those of requests no longer sent there."""
        deltas, failed = [], []
        for d in out.deltas:
            t = self._tracks.get(d.request_id)
            if t is None or t.replica != name:
                continue
            t.streamed = True
            if d.finished:
                self._end(d.request_id)
            deltas.append(d)
        for rid, why in out.failed:
            t = self._tracks.get(rid)
            if t is not None and t.replica == name:
                self._end(rid)
                failed.append((rid, why))
        refused = [r for r in out.refused if (t := self._tracks.get(r[0])) is not None and t.replica == name]
        for rid, _, _ in refused:
            self._end(rid)
        if deltas or failed or refused:
            self._on_outputs(CoreOutputs(out.step, deltas, failed, refused=refused))
        if out.dead is not None:  # the step loop died but the process lives: restart it
            log.error("replica %s: %s; restarting it", name, out.dead)
            self._replica_down(name, out.dead)
            import_ray().kill(self._actors[name], no_restart=False)

    def _end(self, request_id: str) -> None:
        t = self._tracks.pop(request_id)
        self.router.finish(t.replica)

    def _replica_down(self, name: str, why: str) -> None:
        """Mark a replica down; retry elsewhere its requests that streamed nothing, fail the rest."""
        if self._up[name]:
            self._up[name] = False
            self.num_replica_failures += 1
            self.router.set_up(name, False)
            log.error("replica %s is down (%s)", name, why)
        failed = []
        for rid, t in [(r, t) for r, t in self._tracks.items() if t.replica == name]:
            self.router.finish(name)
            if not t.streamed and t.retries < self.max_retries:
                try:
                    t.replica = self.router.route(t.msg.prompt_token_ids)
                except NoReplica:
                    pass
                else:
                    t.retries += 1
                    self.num_retried += 1
                    self._send(t.replica, add=t.msg)
                    if self.on_moved is not None:
                        self.on_moved(rid, t.replica)
                    continue
            del self._tracks[rid]
            failed.append((rid, f"engine replica {name} failed ({why}) after the request had started"
                           if t.streamed else f"engine replica {name} failed ({why}) and no other could take it"))
        if failed:
            self._on_outputs(CoreOutputs(-1, failed=failed))

    async def _await_restart(self, name: str) -> None:
        """Wait for Ray to bring the replica back (its calls queue while it restarts)."""
        ray = import_ray()
        while not self._closing:
            try:
                info = await self._actors[name].ready.remote()
            except ray.exceptions.RayError:
                await asyncio.sleep(1.0)
                continue
            self._info[name] = info
            self._up[name] = True
            self.router.set_up(name, True)
            log.warning("replica %s is back (pid %d on %s)", name, info.pid, info.node_ip)
            return

