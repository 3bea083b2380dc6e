"""min_tokens (vLLM's): EOS and stop_token_ids cannot be sampled before that many output tokens, greedy,
sampled or speculative; the reported logprobs stay the model's raw ones."""

import pytest
import torch
from drive import run_requests

from tokenhaul.decoding.sampler import sample
from tokenhaul.engine.request import Request
from tokenhaul.errors import RequestError
from tokenhaul.sampling_params import SamplingParams

LOGITS = torch.tensor([1.0, 3.0, 2.0, 0.5, 2.9])
PROMPT = [5, 6, 7, 8]


def test_sampler_masks_eos_and_stop_ids_until_min_tokens():
    lp = torch.log_softmax(LOGITS, -1)
    for kw, allowed in (({"temperature": 0}, {2}), ({"temperature": 2.0, "top_k": 2, "seed": 1}, {0, 2})):
        r = Request("r", [0], SamplingParams(min_tokens=2, stop_token_ids=[4], logprobs=1, **kw), eos_token_ids=(1,))
        toks = [sample(LOGITS[None].clone(), [r])[0] for _ in range(50)]
        assert {s.token for s in toks} == allowed  # 1 (EOS) and 4 (a stop id) are out, before top-k
        toks = [t for t in toks if t.token == 2]
        assert toks[0].logprob == pytest.approx(lp[2].item()) and toks[0].top_logprobs[0][0] == 1  # raw logprobs
        r.output_token_ids = [2, 2]  # min_tokens reached: EOS is the argmax again
        assert sample(LOGITS[None].clone(), [r])[0].token in (1, 4)


def stopped_output(core, params, eos=()):
    core.add_request("r", PROMPT, params, eos)
    out = []
    while core.has_unfinished():
        for d in core.step():
            out += d.new_token_ids
    return out


@pytest.mark.parametrize("spec", ["off", "prompt_lookup", "jacobi"])
def test_engine_ignores_stops_before_min_tokens(tiny_core, spec):
    plain = run_requests(tiny_core(), [PROMPT], SamplingParams(max_tokens=12, temperature=0, ignore_eos=True))[0]
    stop = plain[0]
    greedy = {"max_tokens": 12, "temperature": 0, "speculative": spec}
    assert stopped_output(tiny_core(), SamplingParams(stop_token_ids=[stop], **greedy)) == [stop]
    for params, eos in ((SamplingParams(stop_token_ids=[stop], min_tokens=5, **greedy), ()),
                        (SamplingParams(min_tokens=5, **greedy), (stop,))):
        out = stopped_output(tiny_core(), params, eos)
        assert len(out) >= 5 and stop not in out[:5]
        assert out[-1] == stop or len(out) == 12  # past min_tokens the stop token stops it again
    for seed in range(4):
        sampled = SamplingParams(max_tokens=12, temperature=1.0, seed=seed, stop_token_ids=plain[:3], min_tokens=6,
                                 speculative=spec)
        out = stopped_output(tiny_core(), sampled, (plain[3],))
        assert len(out) >= 6 and not set(out[:6]) & set(plain[:4])


@pytest.mark.parametrize("kw,msg", [({"min_tokens": -1}, "min_tokens"), ({"min_tokens": 17}, "min_tokens"),
                                    ({"min_tokens": 2.0}, "min_tokens"),
                                    ({"min_tokens": 2, "use_beam_search": True}, "min_tokens")])
def test_bad_min_tokens(kw, msg):
    with pytest.raises(RequestError, match=msg):
        SamplingParams(**kw)
