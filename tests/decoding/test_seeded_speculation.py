"""A seeded sampled request gives the same tokens whether or not it drafts: deterministic drafts (prompt lookup,
Jacobi) are checked against plain sampling's own draws, so speculation pausing, or stopping in a batch above
speculative_max_batch, does not change its text (as greedy speculation reproduces plain greedy)."""

import pytest
import torch
from tiny_models import tiny_model

from tokenhaul.config import EngineConfig
from tokenhaul.decoding.prompt_lookup import PromptLookup
from tokenhaul.decoding.rejection import accept_sampled
from tokenhaul.decoding.sampler import draw
from tokenhaul.engine.core import EngineCore
from tokenhaul.sampling_params import SamplingParams

PROMPT = [7, 9, 7, 7, 9, 9, 7, 9, 7, 7]
BIAS = {7: 8.0, 9: 7.0}  # the random model then mostly picks 7 or 9, at random: drafts both kept and rejected


class SpecCounter:
    def __init__(self) -> None:
        self.proposed = self.accepted = 0

    def on_step(self, record) -> None:
        for _, p, a in record.speculation:
            self.proposed += p
            self.accepted += a

    def on_finish(self, request) -> None:
        pass


def outputs(requests: dict[str, SamplingParams], counter: SpecCounter | None = None) -> dict[str, list[int]]:
    core = EngineCore(EngineConfig(model="tiny", dtype="fp32", num_kv_blocks=256, block_size=4), tiny_model(),
                      observer=counter)
    core.decoder.proposers["prompt_lookup"] = PromptLookup(min_ngram=1)  # a random model rarely copies 2-grams
    for rid, p in requests.items():
        core.add_request(rid, PROMPT if rid.startswith("s") else [5 + len(rid), 6, 8], p)
    out = {rid: [] for rid in requests}
    while core.has_unfinished():
        for d in core.step():
            out[d.request_id] += d.new_token_ids
    return out


@pytest.mark.parametrize("spec", ["prompt_lookup", "jacobi"])
def test_seeded_sampling_same_with_or_without_drafts(spec):
    def seeded(s: int, speculative: str) -> SamplingParams:
        return SamplingParams(max_tokens=24, temperature=1.0, seed=s, speculative=speculative, logit_bias=BIAS)

    plain = outputs({f"s{s}": seeded(s, "off") for s in range(4)})
    counter = SpecCounter()
    drafted = outputs({f"s{s}": seeded(s, spec) for s in range(4)}, counter)
    assert drafted == plain
    assert 0 < counter.accepted < counter.proposed  # drafts were kept and rejected
    crowd = {f"s{s}": seeded(s, spec) for s in range(4)} | {f"o{i}": SamplingParams(max_tokens=24) for i in range(6)}
    got = outputs(crowd)  # 10 running > speculative_max_batch: nothing is drafted
    assert {rid: toks for rid, toks in got.items() if rid.startswith("s")} == plain


def test_deterministic_drafts_take_plain_draws_and_only_their_uniforms():
    """Each kept token is the inverse-CDF draw of its row with the request's next uniform, and the generator ends
    where plain sampling of as many tokens leaves it."""
    g = torch.Generator().manual_seed(0)
    V, k = 5, 3
    p = torch.softmax(torch.randn(k + 1, V, generator=g) * 2, -1)
    for seed in range(30):
        gen, ref = torch.Generator().manual_seed(seed), torch.Generator().manual_seed(seed)
        plain = [int(draw(p[j:j + 1], torch.rand(1, generator=ref))[0]) for j in range(k + 1)]
        drafts = plain[:seed % (k + 1)] + [(plain[seed % (k + 1)] + 1) % V] * (k - seed % (k + 1))
        got = accept_sampled(p, [0], [drafts[:k]], [None], [gen])[0]
        n = len(got)
        assert got == plain[:n] and n == min(seed % (k + 1), k) + 1
        ref = torch.Generator().manual_seed(seed)
        torch.rand(n, generator=ref)
        assert torch.equal(gen.get_state(), ref.get_state())
