"""EngineReplica: the body of one Ray actor — an EngineCore with its own KV cache and ledger
(`CoreLedger`), stepped by a CoreThread inside the actor process. The front end long-polls `poll()`
for outputs (one round trip carries every step finished since the last) and sends `add` / `abort`
messages; all of them are the torch-free types of `engine/messages.py`.

The model is loaded in the step thread, the thread that then runs every step (CPU steps are faster
in the thread that loaded the weights, see `server/app.py`)."""

from __future__ import annotations

import asyncio
import os
import threading
from collections import OrderedDict
from dataclasses import dataclass

from tokenhaul.engine.messages import AbortRequest, AddRequest, CoreLimits, CoreOutputs, CoreStats


@dataclass(frozen=True)
class ReplicaInfo:
    """Who a replica is and where it runs, returned by `ready()` once its model is loaded."""

    name: str
    limits: CoreLimits
    node_ip: str
    node_id: str
    pid: int
    threads: int


class EngineReplica:
    """Use as a Ray actor class (`ray.remote(EngineReplica)`); async, so `poll` can wait while
    `add` and `abort` run."""

    def __init__(self, name: str, model: str, engine_kwargs: dict) -> None:
        self.name = name
        self._model, self._kwargs = model, dict(engine_kwargs)
        self._outbox: list[CoreOutputs] = []
        self._lock = threading.Lock()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._wake: asyncio.Event | None = None
        self._loaded = threading.Event()
        self._load_error: BaseException | None = None
        self._core_thread = None
        self._ledger = None
        self._limits: CoreLimits | None = None
        self._aborted: OrderedDict[str, None] = OrderedDict()  # recent aborts, in case one overtakes its add
        threading.Thread(target=self._load_and_run, name="tokenhaul-core", daemon=True).start()

    def _load_and_run(self) -> None:
        from tokenhaul.engine.core_thread import CoreThread
        from tokenhaul.ledger.core_ledger import CoreLedger
        from tokenhaul.llm import LLM

        try:
            llm = LLM(self._model, **self._kwargs)  # as `tokenhaul serve` loads it: same quantization, draft, ...
            llm.prepare_structured_outputs()
            core = llm.core
            self._ledger = core.observer = CoreLedger(llm.costs)
            self._limits = core.limits()
            self._core_thread = CoreThread(core, self._on_outputs)
        except BaseException as e:  # reported by ready()
            self._load_error = e
            return
        finally:
            self._loaded.set()
        self._core_thread.run()

    def _on_outputs(self, out: CoreOutputs) -> None:
        """Called on the step thread: queue the outputs, wake a waiting poll."""
        with self._lock:
            self._outbox.append(out)
        loop, wake = self._loop, self._wake
        if loop is not None and wake is not None:
            loop.call_soon_threadsafe(wake.set)

    async def ready(self) -> ReplicaInfo:
        """Wait until the model is loaded; raise what stopped it if it could not be."""
        import ray
        import torch

        self._bind()
        await asyncio.to_thread(self._loaded.wait)
        if self._load_error is not None:
            raise self._load_error
        ctx = ray.get_runtime_context()
        return ReplicaInfo(self.name, self._limits, ray.util.get_node_ip_address(), ctx.get_node_id(), os.getpid(),
                           torch.get_num_threads())

    def submit(self, adds: list[AddRequest], aborts: list[AbortRequest]) -> None:
        """Queue new requests, then aborts. Ray does not order calls to an async actor, so an abort
        may arrive before its add: remembered aborts refuse a late add."""
        for m in aborts:
            self._aborted[m.request_id] = None
            if len(self._aborted) > 4096:
                self._aborted.popitem(last=False)
        for m in adds:
            if m.request_id not in self._aborted:
                self._core_thread.add(m)
        for m in aborts:
            self._core_thread.abort(m.request_id, m.reason)

    async def poll(self, timeout: float = 1.0) -> tuple[list[CoreOutputs], CoreStats]:
        """Outputs since the last poll (waiting up to `timeout` s for one) and the latest stats."""
        self._bind()
        self._wake.clear()
        if not self._outbox:
            try:
                await asyncio.wait_for(self._wake.wait(), timeout)
            except TimeoutError:
                pass
        with self._lock:
            outs, self._outbox = self._outbox, []
        return outs, self._core_thread.stats

    def ledger(self, since: int | None = None) -> dict:
        """This replica's ledger snapshot (`CoreLedger.snapshot`), step records after step `since`."""
        return self._ledger.snapshot(since) if self._ledger is not None else {}

    def shutdown(self) -> None:
        if self._core_thread is not None:
            self._core_thread.shutdown()

    def _bind(self) -> None:
        if self._loop is None:
            self._loop = asyncio.get_running_loop()
            self._wake = asyncio.Event()
