"""decoding/prompt_logprobs.py: logprobs of given tokens and the top k, from hidden states a slice at a time."""

from __future__ import annotations

import torch

from tokenhaul.decoding import prompt_logprobs as pl


def test_rows_past_one_slice_equal_a_whole_log_softmax_and_logits_stay_sliced():
    """300 rows (3 slices of ROWS = 128) with mixed k: each row's token logprob and top k are the whole batch's
    log_softmax's; no call turns more than ROWS rows into full-vocabulary logits."""
    g = torch.Generator().manual_seed(0)
    hidden, head = torch.randn(300, 8, generator=g), torch.randn(8, 50, generator=g)
    targets = torch.randint(0, 50, (300,), generator=g).tolist()
    ks = [i % 4 for i in range(300)]
    sizes = []

    def compute_logits(h):
        sizes.append(len(h))
        return h @ head

    got = pl.prompt_logprobs(compute_logits, hidden, targets, ks)
    ref = torch.log_softmax(hidden @ head, -1)
    assert sizes == [pl.ROWS, pl.ROWS, 300 - 2 * pl.ROWS]
    assert [s.token for s in got] == targets
    assert torch.allclose(torch.tensor([s.logprob for s in got]), ref[torch.arange(300), targets], atol=1e-6)
    for i, (s, k) in enumerate(zip(got, ks)):
        if k == 0:
            assert s.top_logprobs is None
            continue
        top = torch.topk(ref[i], k)
        assert [t for t, _ in s.top_logprobs] == top.indices.tolist()
        assert torch.allclose(torch.tensor([v for _, v in s.top_logprobs]), top.values, atol=1e-6)
