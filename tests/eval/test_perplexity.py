"""Perplexity harness (eval/perplexity.py) on a tiny random model: each target scored once, by prefill rows
or by decode steps, against a full forward of the model over the text."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch

from tokenhaul.eval.perplexity import window_nll
from tokenhaul.sampling_params import SamplingParams


def _harness(tiny_core, **kw) -> SimpleNamespace:
    core = tiny_core(num_kv_blocks=256, max_num_batched_tokens=512, enable_prefix_caching=False, **kw)
    return SimpleNamespace(core=core, model=core.model)


def _reference_nll(core, ids: list[int]) -> float:
    """-log p of ids[1:] from one prefill of the whole text (its window holds every token's full context)."""
    core.add_request("ref", ids, SamplingParams(max_tokens=1))
    try:
        inp = core.runner.prepare(core.scheduler.schedule())
        with torch.inference_mode():
            logp = torch.log_softmax(core.model.compute_logits(core.model.forward(inp.input_ids, inp.meta,
                                                                                    core.kv)[:-1]).float(), -1)
        return -logp.gather(1, torch.tensor(ids[1:])[:, None]).sum().item()
    finally:
        core.abort("ref")


@pytest.mark.parametrize("tail", [0, 1, 5, 40])
def test_decode_tail_scores_every_target_once(tiny_core, tail):
    ids = [int(t) for t in torch.randint(0, 97, (150,), generator=torch.Generator().manual_seed(1))]
    llm = _harness(tiny_core)
    ref = _reference_nll(llm.core, ids)
    nll, n = window_nll(llm, ids, window=len(ids), stride=len(ids), decode_tail=tail)  # one window: exact
    assert n == len(ids) - 1
    assert nll == pytest.approx(ref, rel=1e-5)
    assert llm.core.pool.num_free == llm.core.pool.num_blocks  # every window's blocks released


@pytest.mark.parametrize("window,stride,tail,unscored", [(64, 16, 16, 0), (64, 32, 8, 0), (64, 16, 30, 0),
                                                         (50, 50, 49, 4)])
def test_sliding_windows_count_each_target_once(tiny_core, window, stride, tail, unscored):
    """A tail longer than the stride shrinks to the window's new targets; the count never changes. Windows
    that do not overlap leave their first tokens unscored (no context)."""
    ids = [int(t) for t in torch.randint(0, 97, (203,), generator=torch.Generator().manual_seed(2))]
    llm = _harness(tiny_core)
    prefill, n0 = window_nll(llm, ids, window, stride)
    decoded, n1 = window_nll(llm, ids, window, stride, decode_tail=tail)
    assert n0 == n1 == len(ids) - 1 - unscored
    assert decoded == pytest.approx(prefill, rel=1e-5)  # fp32 KV: the decode path gives the prefill's numbers


def test_int8_kv_decode_tail_stays_close(tiny_core):
    """Int8 KV read by decode steps: the same targets, perplexity within a few percent of fp32 KV's."""
    ids = [int(t) for t in torch.randint(0, 97, (120,), generator=torch.Generator().manual_seed(3))]
    exact, n = window_nll(_harness(tiny_core), ids, 120, 120, decode_tail=60)
    int8, m = window_nll(_harness(tiny_core, kv_dtype="int8"), ids, 120, 120, decode_tail=60)
    assert n == m
    assert math.exp(int8 / m) == pytest.approx(math.exp(exact / n), rel=0.03)


@pytest.mark.parametrize("sparsity", [0.0, 0.4])
def test_eval_ppl_names_its_sparsity(sparsity):
    """The text line and --json say the activation sparsity the perplexity was measured at."""
    from tokenhaul.cli import build_parser
    from tokenhaul.cli.eval_ppl import result, result_line

    args = build_parser().parse_args(["eval", "ppl", "--sparsity", str(sparsity), "--decode-tail", "8"])
    measured = {"perplexity": 9.5, "tokens": 100, "seconds": 1.04,
                "parts": {"en": {"perplexity": 9.25, "tokens": 60}, "code": {"perplexity": 9.875, "tokens": 40}}}
    res = result(args, "smollm2-135m", measured)
    assert res["sparsity"] == sparsity and res["decode_tail"] == 8 and res["perplexity"] == 9.5
    sparse = " sparsity 0.4" if sparsity else ""
    assert result_line(res) == (f"smollm2-135m {args.quantization} {args.dtype} kv {args.kv_dtype}{sparse}, last 8 "
                                "of each window decoded: perplexity 9.5000 over 100 tokens [en 9.250 (60 tokens), "
                                "code 9.875 (40 tokens)] in 1.0 s")
