"""Request: one sequence's state as the engine core sees it — token ids only, no text.

Scheduling is in tokens, not phases: `num_computed_tokens` catches up with `num_tokens_with_drafts`;
that one piece of arithmetic covers prefill chunks, prefix-cache hits, decode, recompute after
preemption and the verification of draft tokens (proposed by a strategy in decoding/, not yet accepted).
"""

from __future__ import annotations

import enum
import itertools
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from tokenhaul.engine.messages import Sample
from tokenhaul.kv.manager import KVHolder
from tokenhaul.sampling_params import SamplingParams

if TYPE_CHECKING:
    from tokenhaul.decoding.grammar import Grammar

_arrival = itertools.count()


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass
class Request:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    eos_token_ids: tuple[int, ...] = ()
    priority: int = 0  # lower runs first; ties FCFS
    arrival: int = field(default_factory=lambda: next(_arrival))
    arrival_time: float = field(default_factory=time.perf_counter)
    output_token_ids: list[int] = field(default_factory=list)
    status: Status = Status.WAITING
    finish_reason: str | None = None
    stop_reason: int | None = None  # the stop_token_ids token it stopped at (EOS: None), as vLLM
    num_computed_tokens: int = 0
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache (first admission)
    num_preemptions: int = 0
    block_ids: list[int] = field(default_factory=list)  # append-only while running
    block_hashes: list[int] = field(default_factory=list)
    generator: torch.Generator | None = None
    draft_token_ids: list[int] = field(default_factory=list)  # proposed after the last token, to verify
    num_lookahead: int = 0  # KV slots to reserve past the scheduled tokens for the next proposal
    kv_heir: KVHolder | None = None  # at finish its blocks are forked here before being freed (tree search)
    prompt_logprobs: list[Sample | None] | None = None  # asked for: one per prompt token collected so far
    grammar: Grammar | None = None  # structured outputs' matcher (decoding/grammar.py), fed each appended token
    beam_group: str | None = None  # a beam of this beam search group (decoding/beam.py): admitted as a whole

    def __post_init__(self) -> None:
        if self.params.seed is not None:
            self.generator = torch.Generator().manual_seed(self.params.seed)
        if self.params.prompt_logprobs is not None:
            self.prompt_logprobs = [None]  # the first prompt token follows nothing

    @property
    def needs_prompt_logprobs(self) -> bool:
        """Prompt logprobs were asked for and some are still to compute (its prompt may not come from the
        prefix cache: every position's logits are needed)."""
        return self.prompt_logprobs is not None and len(self.prompt_logprobs) < len(self.prompt_token_ids)

    def prompt_logprob_positions(self, start: int, num_tokens: int) -> range:
        """Positions among [start, start + num_tokens) whose logits give a prompt logprob not yet collected
        (position i predicts prompt token i + 1)."""
        if self.prompt_logprobs is None:
            return range(0)
        return range(max(start, len(self.prompt_logprobs) - 1), min(start + num_tokens, len(self.prompt_token_ids) - 1))

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_tokens_with_drafts(self) -> int:
        return self.num_tokens + len(self.draft_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def sort_key(self) -> tuple[int, int]:
        return (self.priority, self.arrival)

    def token_slice(self, start: int, end: int) -> list[int]:
        """Token ids [start, end) of prompt + output + drafts, without building the whole list."""
        p, n = len(self.prompt_token_ids), self.num_tokens
        if end > n:
            return self.token_slice(start, n) + self.draft_token_ids[max(0, start - n):end - n]
        if start >= p:
            return self.output_token_ids[start - p:end - p]
        if end <= p:
            return self.prompt_token_ids[start:end]
        return self.prompt_token_ids[start:] + self.output_token_ids[:end - p]
