"""CoreThread: the engine core's step loop in its own thread. The only code that calls the core.

Messages in (`AddRequest`, `AbortRequest`) arrive through a thread-safe queue and are applied
between steps; each step's token-id deltas go out through a callback (the front end hands them to
its event loop). Everything crossing the boundary is a small plain dataclass of ints and strings,
so the thread could become a process without changing either side."""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import queue
import threading
import time
import traceback
from collections.abc import Callable

from tokenhaul.engine.core import EngineCore
from tokenhaul.engine.heap import frozen_heap
from tokenhaul.engine.messages import AbortRequest, AddRequest, CoreOutputs
from tokenhaul.errors import CapacityError, RequestError, TokenhaulError

log = logging.getLogger("tokenhaul.engine")


class CoreThread:
    """Owns an EngineCore and runs its step loop (in its own thread, or in the caller's: `run`).
    `add`/`abort` may be called from any thread; `on_outputs` is called from the loop's thread
    after each step that produced something."""

    def __init__(self, core: EngineCore, on_outputs: Callable[[CoreOutputs], None]) -> None:
        self.core = core
        self.limits = core.limits()  # fixed: safe to read from any thread
        self.stats = core.stats()  # a snapshot replaced after every loop turn, never mutated
        self._on_outputs = on_outputs
        self._inbox: queue.SimpleQueue[AddRequest | AbortRequest | None] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self.run, name="tokenhaul-core", daemon=True)
        self._running = False
        self._step_seconds = 0.0
        self.error: BaseException | None = None  # set if the loop itself died

    # any thread ----------------------------------------------------------------------------
    def start(self) -> None:
        """Run the loop in a new thread."""
        self._running = True
        self._thread.start()

    def add(self, msg: AddRequest) -> None:
        self._inbox.put(msg)

    def abort(self, request_id: str, reason: str = "abort") -> None:
        self._inbox.put(AbortRequest(request_id, reason))

    def shutdown(self, timeout: float = 10.0) -> None:
        """Ask the loop to return (wherever it runs); join it if it runs in its own thread."""
        self._inbox.put(None)
        if self._thread.is_alive():
            self._thread.join(timeout)

    @property
    def alive(self) -> bool:
        return self._running

    # the loop --------------------------------------------------------------------------------
    def run(self) -> None:
        """The step loop, in the calling thread, until shutdown() (or a crash, reported as `dead`).
        `start()` runs it in a new thread; `tokenhaul serve` runs it in the main thread, where the
        model was loaded: steps there are faster on CPU (per-thread OpenMP/MKL state). The heap that exists
        when it starts is kept from the garbage collector (engine/heap.py)."""
        with frozen_heap():
            self._loop()

    def _loop(self) -> None:
        self._running = True
        try:
            while True:
                msgs = self._drain(block=not self.core.has_unfinished())
                out = CoreOutputs(self.core.num_steps)
                for m in msgs:
                    if m is None:
                        return
                    self._apply(m, out)
                if self.core.has_unfinished():
                    t0 = time.perf_counter()
                    try:
                        out.deltas = self.core.step()
                    except Exception:  # a broken step must not take the server, or the batch, down
                        log.error("engine step failed; isolating the request that causes it:\n%s",
                                  traceback.format_exc())
                        self._publish(out)
                        out = CoreOutputs(self.core.num_steps)
                        self._isolate(self.core.request_ids(), out.failed)
                    self._step_seconds += time.perf_counter() - t0
                self._publish(out)
        except BaseException as e:
            self.error = e
            self._running = False  # before the news goes out: whoever hears it must see a dead loop
            if not isinstance(e, KeyboardInterrupt):
                log.critical("core loop died:\n%s", traceback.format_exc())
            self._on_outputs(CoreOutputs(self.core.num_steps, dead="the engine stopped unexpectedly; the server "
                                                                    "log has the details"))
        finally:
            self._running = False

    def _publish(self, out: CoreOutputs) -> None:
        self.stats = dataclasses.replace(self.core.stats(), step_seconds=self._step_seconds)
        if out.deltas or out.failed or out.refused:
            self._on_outputs(out)

    def _isolate(self, suspects: list[str], failed: list[tuple[str, str]]) -> None:
        """A step over `suspects` (and maybe others) just failed: step each half alone, recursing
        into a half that fails too. A request is failed only when a step of its own failed; the
        rest keep going (each successful half-step is a real step, published as it comes)."""
        if len(suspects) == 1:
            rid = suspects[0]
            log.error("request %s fails the engine step on its own; it is failed, the batch goes on", rid)
            try:
                self.core.abort(rid, "error")
            except Exception:  # state left half-updated by the failed step
                log.error("abort of %s after a failed step:\n%s", rid, traceback.format_exc())
            failed.append((rid, _failed_message(rid)))
            return
        mid = len(suspects) // 2
        for part in (suspects[:mid], suspects[mid:]):
            unfinished = self.core.request_ids()
            part = [rid for rid in part if rid in unfinished]
            if not part:
                continue
            t = self.core.num_steps
            try:
                deltas = self.core.step_only(part)
            except Exception as e:
                if isinstance(e, CapacityError) and len(part) < len(unfinished):
                    continue  # inconclusive: the held-out requests hold the blocks this part needs
                log.error("a step of %d suspects failed:\n%s", len(part), traceback.format_exc())
                self._isolate(part, failed)
                continue
            self._publish(CoreOutputs(t, deltas))

    def _drain(self, block: bool) -> list[AddRequest | AbortRequest | None]:
        msgs = []
        while block and not msgs:  # wake up now and then, so a signal can reach the main thread
            with contextlib.suppress(queue.Empty):
                msgs.append(self._inbox.get(timeout=1.0))
        while True:
            try:
                msgs.append(self._inbox.get_nowait())
            except queue.Empty:
                return msgs

    def _apply(self, m: AddRequest | AbortRequest, out: CoreOutputs) -> None:
        if isinstance(m, AbortRequest):
            self.core.abort(m.request_id, m.reason)
            return
        try:
            self.core.add_request(m.request_id, m.prompt_token_ids, m.params, m.eos_token_ids)
        except RequestError as e:  # refused at admission (CapacityError too)
            out.refused.append((m.request_id, "capacity" if isinstance(e, CapacityError) else "request", str(e)))
        except TokenhaulError as e:
            out.failed.append((m.request_id, str(e)))
        except Exception:  # a defect reached by one request's parameters: that request fails, not the loop
            log.error("adding request %s failed:\n%s", m.request_id, traceback.format_exc())
            self.core.abort(m.request_id)
            out.failed.append((m.request_id, _failed_message(m.request_id)))



def _failed_message(request_id: str) -> str:
    """What a client learns of an internal failure: no internals, an id to find it in the log."""
    return f"internal error in the engine while serving request {request_id}; the server log has the details"
