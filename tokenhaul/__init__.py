"""tokenhaul: an LLM inference engine built around data movement."""

from __future__ import annotations

from typing import TYPE_CHECKING

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
