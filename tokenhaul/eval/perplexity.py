"""Perplexity with sliding windows, through the model exactly as the engine runs it (paged KV, packed
weights): each window is one prefill chunk; its tokens past the previous window's end are scored."""

from __future__ import annotations

import math
import time
from collections.abc import Iterator
from pathlib import Path

import torch

from tokenhaul.errors import RequestError
from tokenhaul.sampling_params import SamplingParams

CORPUS_DIR = Path(__file__).parent / "corpus"
PARTS = ("en", "zh", "code")  # English prose, Chinese, Python source; licences in corpus/README.md


def corpus_ids(tokenizer, corpus: Path | None, max_tokens: int | None) -> dict[str, list[int]]:
    """Token ids per part: the shipped corpus (each part capped at an equal share of max_tokens) or one file."""
    if corpus is not None:
        try:
            text = Path(corpus).read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as e:
            raise RequestError(f"cannot read corpus {corpus}: {e}") from None
        ids = tokenizer.encode(text)
        if len(ids) < 2:
            raise RequestError(f"corpus {corpus} has fewer than 2 tokens")
        return {Path(corpus).stem: ids[:max_tokens]}
    share = None if max_tokens is None else max(2, max_tokens // len(PARTS))
    return {p: tokenizer.encode((CORPUS_DIR / f"{p}.txt").read_text(encoding="utf-8"))[:share] for p in PARTS}


@torch.inference_mode()
def window_nll(llm, ids: list[int], window: int, stride: int, decode_tail: int = 0) -> tuple[float, int]:
    """Sum of -log p over ids[1:] and its count, each token scored once with up to `window` tokens of context
    (with stride == window, each window's first token is not scored: nothing precedes it there). A window's
    last `decode_tail` tokens enter one per step as decodes (the path generation takes: the decode attention
    kernel, the compiled step), the rest as one prefill chunk."""
    core, model = llm.core, llm.model
    total, count, scored_to = 0.0, 0, 1
    for begin in range(0, len(ids), stride):
        end = min(begin + window, len(ids))
        scored_to = max(scored_to, begin + 1)  # windows that do not overlap: a window's first token has no context
        tail = min(decode_tail, end - scored_to)  # never a target scored before
        params = SamplingParams(max_tokens=tail + 1, ignore_eos=True)
        core.add_request("ppl", ids[begin:end - tail], params)
        try:
            sched = core.scheduler.schedule()
            inp = core.runner.prepare(sched)
            assert inp.input_ids.shape[0] == end - tail - begin, "a window must be one prefill chunk"
            first = scored_to - begin  # rows of targets not yet scored
            last = end - begin - 1 - max(tail, 1)  # the prefill's last scoring row predicts ids[end - max(tail, 1)]
            hidden = model.forward(inp.input_ids, inp.meta, core.kv)[first - 1:last + 1]
            logp = [torch.log_softmax(model.compute_logits(hidden).float(), dim=-1),
                    *teacher_forced(core, sched, "ppl", ids[end - tail:end - 1])]  # each scores the next id
            targets = torch.tensor(ids[scored_to:end], device=logp[0].device)
            total -= torch.cat(logp).gather(1, targets[:, None]).sum().item()
            count += end - scored_to
            scored_to = end
        finally:
            core.abort("ppl")
        if end == len(ids):
            break
    return total, count


def teacher_forced(core, sched, request_id: str, tokens: list[int]) -> Iterator[torch.Tensor]:
    """After step `sched` computed request_id's last token, feed `tokens` one per decode step as if it had
    generated them; yields each step's log-probabilities [1, vocab] (fp32). The request must allow that many."""
    for tok in tokens:
        core.scheduler.update(sched, {request_id: [tok]})
        sched = core.scheduler.schedule()
        yield torch.log_softmax(core.runner.forward(core.runner.prepare(sched)), dim=-1)


def evaluate(llm, corpus: Path | None = None, max_tokens: int | None = None, window: int = 512,
             stride: int = 256, decode_tail: int = 0) -> dict:
    """{"perplexity", "tokens", "parts": {name: {"perplexity", "tokens"}}, "seconds"} over the corpus."""
    t0 = time.perf_counter()
    parts = {}
    nll = n = 0
    for name, ids in corpus_ids(llm.tokenizer, corpus, max_tokens).items():
        s, c = window_nll(llm, ids, window, stride, decode_tail)
        parts[name] = {"perplexity": math.exp(s / c), "tokens": c}
        nll, n = nll + s, n + c
    return {"perplexity": math.exp(nll / n), "tokens": n, "parts": parts,
            "seconds": time.perf_counter() - t0}
