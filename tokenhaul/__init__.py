"""tokenhaul: an LLM inference engine built around data movement."""

from tokenhaul.llm import LLM
from tokenhaul.outputs import RequestOutput
from tokenhaul.sampling_params import SamplingParams

__all__ = ["LLM", "RequestOutput", "SamplingParams"]
