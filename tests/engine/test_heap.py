"""A step loop runs with the heap it found frozen (out of the cyclic collector's sight) and hands it back when
it ends: nested loops freeze once, and only the last exit unfreezes. (Another test's server may still be running
its loop in this process: `outer` counts those.)"""

from __future__ import annotations

import gc
import threading

from tiny_models import tiny_model

from tokenhaul.config import EngineConfig
from tokenhaul.engine import heap
from tokenhaul.engine.core import EngineCore
from tokenhaul.engine.core_thread import CoreThread
from tokenhaul.engine.heap import frozen_heap
from tokenhaul.engine.messages import AddRequest, CoreOutputs
from tokenhaul.sampling_params import SamplingParams


def handed_back(outer: int) -> bool:
    """The heap is as the test found it: unfrozen unless an outer loop still runs."""
    return heap._depth == outer and (gc.get_freeze_count() == 0) == (outer == 0)


def test_nested_loops_freeze_once_and_hand_back_on_the_last_exit(monkeypatch):
    outer = heap._depth
    calls: list[str] = []
    freeze, unfreeze = gc.freeze, gc.unfreeze
    monkeypatch.setattr(gc, "freeze", lambda: calls.append("freeze") or freeze())
    monkeypatch.setattr(gc, "unfreeze", lambda: calls.append("unfreeze") or unfreeze())
    with frozen_heap():
        assert gc.get_freeze_count() > 1000  # everything the test process held
        with frozen_heap():
            pass
        # The inner exit keeps it frozen. (Not an exact count: a frozen object another thread drops leaves it.)
        assert gc.get_freeze_count() > 1000
    assert calls == (["freeze", "unfreeze"] if outer == 0 else [])
    assert handed_back(outer)


def test_core_thread_steps_on_a_frozen_heap_and_hands_it_back():
    outer = heap._depth
    core = EngineCore(EngineConfig(model="tiny", dtype="fp32", num_kv_blocks=64, block_size=4), tiny_model())
    frozen_during_steps: list[int] = []
    step = core.step
    core.step = lambda: frozen_during_steps.append(gc.get_freeze_count()) or step()
    done = threading.Event()

    def on_outputs(out: CoreOutputs) -> None:
        if any(d.finished for d in out.deltas):
            done.set()

    ct = CoreThread(core, on_outputs)
    ct.add(AddRequest("a", [5, 6, 7], SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)))
    ct.start()
    assert done.wait(60)
    ct.shutdown()
    assert len(frozen_during_steps) >= 4 and min(frozen_during_steps) > 1000
    assert handed_back(outer)
