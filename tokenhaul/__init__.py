"""tokenhaul: an LLM inference engine built around data movement."""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

# OpenMP threads sleep instead of spinning between ops (read once, when torch loads). Measured on the
# shared 2-core machine: with the default spin-wait a decode step ran ~50x slower while other processes
# held the cores (profile: the int4 GEMV went from 94 us to 8.7 ms per call); see MACHINE.md. The
# environment still wins: OMP_WAIT_POLICY=ACTIVE for a quiet, dedicated machine.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

from tokenhaul.sampling_params import SamplingParams

if TYPE_CHECKING:
    from tokenhaul.llm import LLM
    from tokenhaul.outputs import RequestOutput

__all__ = ["LLM", "RequestOutput", "SamplingParams"]


def __getattr__(name: str) -> object:
    """LLM and RequestOutput load torch: import them on first use, so torch-free modules stay so."""
    if name == "LLM":
        from tokenhaul.llm import LLM

        return LLM
    if name == "RequestOutput":
        from tokenhaul.outputs import RequestOutput

        return RequestOutput
    raise AttributeError(f"module 'tokenhaul' has no attribute {name!r}")
