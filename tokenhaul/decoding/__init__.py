"""Decoding strategies behind one interface (decoder.Proposer); the registry maps
`SamplingParams.speculative` to the strategies that need no model of their own ("draft" is added by
the engine when it holds a draft model)."""

from tokenhaul.decoding.jacobi import Jacobi
from tokenhaul.decoding.prompt_lookup import PromptLookup

PROPOSERS = {"prompt_lookup": PromptLookup, "jacobi": Jacobi}
