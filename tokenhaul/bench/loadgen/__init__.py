"""Load generator for any OpenAI-compatible server: streamed /v1/completions over httpx.

Requests arrive as a Poisson process (`rate` per second; inf → all at once), at most
`concurrency` in flight. Per request it times TTFT (first chunk with text), every inter-chunk gap
(ITL), TPOT = (E2E - TTFT) / (output tokens - 1) and E2E; the summary gives mean / p50 / p90 / p99
/ max, the ITL p99/p50 ratio (how even a stream feels), throughput, the mean number of requests in
flight, and goodput (requests per second meeting every SLO given; the ITL SLO bounds a request's
longest gap). The `mixed` dataset mixes long and short prompts, as a chat server sees them. Output token counts come
from the server's usage chunk (stream_options.include_usage), else from the number of text chunks.
If the server exports tokenhaul's /metrics, the front end's last-mile cost per token is reported;
if it has tokenhaul's /ledger, per engine replica (the `x-tokenhaul-replica` header names it) the
prefix hit rate, the prompt tokens it computed and what its prefix-cache misses cost in bytes, and
the prefix tokens computed on a second replica after another had been sent them.
"""

from tokenhaul.bench.loadgen.client import RequestResult, base_url, run_load
from tokenhaul.bench.loadgen.datasets import _WORDS, PromptSpec, file_dataset, mixed_dataset, random_dataset
from tokenhaul.bench.loadgen.run import benchmark
from tokenhaul.bench.loadgen.scrape import ledger_figures, scrape_last_mile, scrape_ledger
from tokenhaul.bench.loadgen.summary import format_table, summarize

__all__ = ["_WORDS", "PromptSpec", "RequestResult", "base_url", "benchmark", "file_dataset", "format_table",
           "ledger_figures", "mixed_dataset", "random_dataset", "run_load", "scrape_last_mile", "scrape_ledger",
           "summarize"]
