"""EngineClient: the front end's one interface to engine cores, whatever runs them — a thread in this
process (`InProcessClient`) or Ray actors on one or many machines (`cluster.pool.ReplicaPool`).

    front end ──add(AddRequest) / abort(id)──► client ──► core(s)
        ▲                                                    │
        └──────────── on_outputs(CoreOutputs), on the front end's event loop ◄┘

Everything that crosses is a message of `engine/messages.py`; the front end reads the cores' state
only through `replicas()` snapshots, never their scheduler, pool or model."""

from __future__ import annotations

import asyncio
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from tokenhaul.engine.messages import AddRequest, CoreLimits, CoreOutputs, CoreStats

if TYPE_CHECKING:  # the core loads torch; this module does not
    from tokenhaul.engine.core import EngineCore, StepRecord
    from tokenhaul.engine.request import Request

OnOutputs = Callable[[CoreOutputs], None]


class ReadableObserver(Protocol):
    """A core's step observer (engine/core.py) the front end can read — ledger/core_ledger.py's
    CoreLedger; plain dicts only."""

    def on_step(self, record: StepRecord) -> None: ...

    def on_finish(self, request: Request) -> None: ...

    def snapshot(self, since: int | None = None) -> dict[str, Any]: ...


@dataclass(frozen=True)
class ReplicaState:
    """One core as the front end sees it: a name (the `x-tokenhaul-replica` header), up or not,
    its latest stats snapshot, and where it runs."""

    name: str
    up: bool
    stats: CoreStats
    where: str = "in-process"


class EngineClient(ABC):
    """Called from one event loop (the serving one), except `run` and `close`."""

    limits: CoreLimits
    # whether a request can be retried on another replica before it streamed (ReplicaPool): then an SSE response
    # waits for output before it sends its headers (naming the replica) and first chunk (server/serving.py)
    moves_requests: bool = False
    # set by the front end: called with (request id, replica name) when a client retries a request on another
    # replica before it streamed anything (ReplicaPool); a client that never moves requests never calls it
    on_moved: Callable[[str, str], None] | None = None

    @abstractmethod
    async def start(self, on_outputs: OnOutputs, start_core: bool = True) -> None:
        """Bind to the running loop and start delivering outputs to `on_outputs` there. With
        start_core=False an in-process core waits for `run()` to step it in the caller's thread."""

    @abstractmethod
    def add(self, msg: AddRequest) -> str:
        """Send a request to a core; returns the name of the replica it went to."""

    @abstractmethod
    def abort(self, request_id: str, reason: str = "abort") -> None:
        """Finish a request now (a no-op if it already finished); its KV blocks are freed."""

    @property
    @abstractmethod
    def alive(self) -> bool:
        """At least one core can take requests."""

    @abstractmethod
    def replicas(self) -> list[ReplicaState]:
        """The latest snapshot of every core."""

    @property
    def error(self) -> BaseException | None:
        """What killed the client's own loop, if one died (then `run()` has returned)."""
        return None

    def routing(self) -> dict[str, int]:
        """Routing decisions by kind since start (empty when there is nothing to route)."""
        return {}

    async def ledgers(self, since: int | None = None) -> dict[str, dict]:
        """Each reachable core's ledger snapshot by replica name (`ledger/core_ledger.py`), with its step
        records after step `since` (none when None); empty where the cores keep no ledger."""
        return {}

    @abstractmethod
    def run(self) -> None:
        """Block the calling thread until `shutdown()`, doing there whatever this client needs a
        thread for (the in-process client steps its core here)."""

    @abstractmethod
    def close(self) -> None:
        """Stop the cores and end `run()`; requests still running are lost (the front end fails them
        first). Blocking, idempotent, callable from any thread."""


class InProcessClient(EngineClient):
    """One EngineCore stepped by a CoreThread in this process (its own thread, or `run()`'s); with a
    `ledger` (a ReadableObserver, e.g. a CoreLedger) attached as the core's observer."""

    NAME = "0"

    def __init__(self, core: EngineCore, ledger: ReadableObserver | None = None) -> None:
        from tokenhaul.engine.core_thread import CoreThread

        self.ledger = ledger
        if ledger is not None:
            core.observer = ledger
        self.limits = core.limits()
        self.core_thread = CoreThread(core, self._from_core_thread)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._on_outputs: OnOutputs | None = None

    async def start(self, on_outputs: OnOutputs, start_core: bool = True) -> None:
        self._loop, self._on_outputs = asyncio.get_running_loop(), on_outputs
        if start_core:
            self.core_thread.start()

    def _from_core_thread(self, out: CoreOutputs) -> None:
        """On the core thread: hand the step's outputs to the event loop, never wait for it."""
        loop = self._loop
        if loop is not None and not loop.is_closed():
            try:
                loop.call_soon_threadsafe(self._on_outputs, out)
            except RuntimeError:  # the loop closed between the check and the call
                pass

    def add(self, msg: AddRequest) -> str:
        self.core_thread.add(msg)
        return self.NAME

    def abort(self, request_id: str, reason: str = "abort") -> None:
        self.core_thread.abort(request_id, reason)

    @property
    def alive(self) -> bool:
        return self.core_thread.alive

    @property
    def error(self) -> BaseException | None:
        return self.core_thread.error

    def replicas(self) -> list[ReplicaState]:
        return [ReplicaState(self.NAME, self.core_thread.alive, self.core_thread.stats)]

    async def ledgers(self, since: int | None = None) -> dict[str, dict]:
        return {} if self.ledger is None else {self.NAME: self.ledger.snapshot(since)}

    def run(self) -> None:
        self.core_thread.run()

    def close(self) -> None:
        self.core_thread.shutdown()
