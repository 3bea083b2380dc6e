"""Rejection sampling keeps the target's distribution exactly: chi-square tests on fixed distributions
and on a tiny target/draft model pair, each paired with a check that the test can fail."""

from __future__ import annotations

import torch
from tiny_models import tiny_model

from tokenhaul.config import EngineConfig
from tokenhaul.decoding.rejection import accept_greedy, accept_sampled
from tokenhaul.decoding.sampler import SamplingBatch, probabilities
from tokenhaul.engine.core import EngineCore
from tokenhaul.sampling_params import SamplingParams


def chi2_pvalue(counts: torch.Tensor, probs: torch.Tensor) -> float:
    """Pearson's chi-square goodness of fit (bins expecting < 5 pooled into one); p-value from the
    regularised upper incomplete gamma."""
    n = counts.sum()
    expected = probs.double() * n
    small = expected < 5
    if bool(small.any()):
        counts = torch.cat([counts[~small], counts[small].sum()[None]])
        expected = torch.cat([expected[~small], expected[small].sum()[None]])
    assert float(expected.min()) >= 5, "too few samples for chi-square"
    stat = ((counts.double() - expected) ** 2 / expected).sum()
    df = torch.tensor(len(expected) - 1, dtype=torch.double)
    return float(torch.special.gammaincc(df / 2, stat / 2))


def test_accept_greedy():
    assert accept_greedy([5, 6, 7], [5, 6]) == [5, 6, 7]
    assert accept_greedy([5, 9, 7], [5, 6]) == [5, 9]
    assert accept_greedy([4, 6, 7], [5, 6]) == [4]
    assert accept_greedy([3], []) == [3]


def test_rejection_sampling_keeps_target_distribution():
    g = torch.Generator().manual_seed(0)
    V, k, N = 6, 2, 20000
    p = torch.softmax(torch.randn(k + 1, V, generator=g) * 1.5, -1)
    q = torch.softmax(torch.randn(k, V, generator=g) * 1.5, -1)
    drafts = [[int(torch.multinomial(q[j], 1, generator=g)) for j in range(k)] for _ in range(N)]
    probs = p.repeat(N, 1)
    gens = [torch.Generator().manual_seed(i) for i in range(N)]
    out = accept_sampled(probs, [i * (k + 1) for i in range(N)], drafts, [q] * N, gens)
    first = torch.bincount(torch.tensor([o[0] for o in out]), minlength=V)
    assert chi2_pvalue(first, p[0]) > 1e-3
    assert chi2_pvalue(first, q[0]) < 1e-6  # the test can fail: the draft's own distribution is rejected
    second = torch.bincount(torch.tensor([o[1] for o in out if len(o) > 1]), minlength=V)
    assert chi2_pvalue(second, p[1]) > 1e-3
    # deterministic drafts (one-hot q, as prompt lookup proposes)
    fixed = accept_sampled(probs, [i * (k + 1) for i in range(N)], [[1, 2]] * N, [None] * N, gens)
    assert chi2_pvalue(torch.bincount(torch.tensor([o[0] for o in fixed]), minlength=V), p[0]) > 1e-3


def exact_pair(model, prompt: list[int], vocab: int) -> torch.Tensor:
    """p(t2, t3 | prompt) of the model at temperature 1 (t1 summed out), computed by forward passes."""
    core = EngineCore(EngineConfig(model="tiny", dtype="fp32", num_kv_blocks=64, block_size=4), model)
    params = SamplingParams(temperature=1.0)

    def dist(tokens):
        core.add_request("x", tokens, params)
        inp = core.runner.prepare(core.scheduler.schedule())
        logits = core.runner.forward(inp)
        req = inp.sample_chunks[0].request
        core.abort("x")
        return probabilities(logits, SamplingBatch.build([req], vocab))[0]

    p1 = dist(prompt)
    joint = torch.zeros(vocab, vocab)
    for t1 in range(vocab):
        p2 = dist(prompt + [t1])
        joint += p1[t1] * torch.stack([p2[t2] * dist(prompt + [t1, t2]) for t2 in range(vocab)])
    return joint.flatten()


def test_chi_square_draft_speculation_on_tiny_models():
    """4096 seeded requests draw 4 tokens, a tiny draft model proposing after the first; the joint
    distribution of tokens 2 and 3 (verified together) matches the target's, and not the draft's."""
    V, N, prompt = 6, 4096, [1, 4, 2, 5, 3]
    target, draft = tiny_model(vocab_size=V, seed=0), tiny_model(vocab_size=V, seed=1)
    cfg = EngineConfig(model="tiny", dtype="fp32", num_kv_blocks=4096, block_size=4, max_num_seqs=1024,
                       max_num_batched_tokens=8192, speculative_max_batch=1024)
    core = EngineCore(cfg, target, draft_model=draft)
    for i in range(N):
        core.add_request(f"r{i}", prompt, SamplingParams(max_tokens=4, temperature=1.0, seed=i, ignore_eos=True,
                                                         speculative="draft", num_speculative_tokens=3))
    out: dict[str, list[int]] = {}
    proposed = 0
    while core.has_unfinished():
        for d in core.step():
            out.setdefault(d.request_id, []).extend(d.new_token_ids)
        proposed += sum(len(r.draft_token_ids) for r in core.scheduler.running)
    assert proposed > N  # most requests verified drafts
    pairs = torch.tensor([o[1] * V + o[2] for o in out.values()])
    counts = torch.bincount(pairs, minlength=V * V)
    assert chi2_pvalue(counts, exact_pair(target, prompt, V)) > 1e-3
    assert chi2_pvalue(counts, exact_pair(draft, prompt, V)) < 1e-6
    assert core.pool.num_used == 0
