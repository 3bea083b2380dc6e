"""tokenhaul: an LLM inference engine built around data movement."""

from __future__ import annotations

import os
from typing import TYPE_CHECKING


def _openmp_wait() -> None:
    """How OpenMP threads wait between ops (libgomp reads it once, when torch loads; the environment wins).
    Measured, SmolLM2 int4 batch-1 decode, 2 threads (MACHINE.md): on idle cores a short spin
    (GOMP_SPINCOUNT=10000) runs 74 tok/s, PASSIVE (sleep at once) 43 — each of ~500 parallel ops a token
    pays a futex wake-up; with another process busy on a core the spin falls to 13 and PASSIVE holds 32.
    So: spin briefly when the cores are idle now, sleep at once when other work holds half of them or more.
    "Now" is 0.1 s of /proc/stat: the 1-minute load average still read ~1 a minute after a benchmark ended and
    chose PASSIVE on idle cores, 47 instead of 201 tok/s (Zen 5 host, bench/RESULTS.md)."""
    if "OMP_WAIT_POLICY" in os.environ or "GOMP_SPINCOUNT" in os.environ:
        return
    from tokenhaul.host import busy_cores

    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    if busy_cores() < 0.5 * cores:
        os.environ["GOMP_SPINCOUNT"] = "10000"
    else:
        os.environ["OMP_WAIT_POLICY"] = "PASSIVE"


_openmp_wait()


def _huge_pages() -> None:
    """Ask torch's CPU allocator for transparent huge pages on blocks of 2 MB and more (c10 reads
    THP_MEM_ALLOC_ENABLE once; the environment wins). Weights stream through fewer TLB entries: measured on this
    CPU, 2 threads, a 136 MB int8 matrix: a plain read 27.8 -> 37.9 GB/s, the int8 GEMV 17.0 -> 22.3 GB/s."""
    os.environ.setdefault("THP_MEM_ALLOC_ENABLE", "1")


_huge_pages()


def _keep_freed_memory() -> None:
    """Keep freed heap memory in the process (tokenhaul/host.py: keep_freed_memory) unless
    TOKENHAUL_KEEP_FREED_MEMORY=0; any MALLOC_* variable in the environment (glibc's own tuning) wins."""
    if os.environ.get("TOKENHAUL_KEEP_FREED_MEMORY") == "0" or any(k.startswith("MALLOC_") for k in os.environ):
        return
    from tokenhaul.host import keep_freed_memory

    keep_freed_memory()


_keep_freed_memory()

from tokenhaul.sampling_params import SamplingParams  # noqa: E402 - after the OpenMP choice
from tokenhaul.structured_outputs import StructuredOutputsParams  # noqa: E402 - SamplingParams imports it anyway

if TYPE_CHECKING:
    from tokenhaul.llm import LLM
    from tokenhaul.outputs import CompletionOutput, Logprob, RequestOutput

__all__ = ["LLM", "CompletionOutput", "Logprob", "RequestOutput", "SamplingParams", "StructuredOutputsParams"]


def __getattr__(name: str) -> object:
    """LLM loads torch: import it on first use, so torch-free modules stay so; the outputs (RequestOutput,
    CompletionOutput, and Logprob as vLLM's `from vllm.logprobs import Logprob`) come the same way."""
    if name == "LLM":
        from tokenhaul.llm import LLM

        return LLM
    if name in ("RequestOutput", "CompletionOutput", "Logprob"):
        from tokenhaul import outputs

        return getattr(outputs, name)
    raise AttributeError(f"module 'tokenhaul' has no attribute {name!r}")
