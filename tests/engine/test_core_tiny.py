"""Engine core on a tiny random model: batching, chunked prefill, preemption, prefix reuse, abort."""

import pytest
from drive import run_requests

from tokenhaul.decoding.sampler import sample
from tokenhaul.errors import CapacityError, RequestError
from tokenhaul.sampling_params import SamplingParams

GREEDY = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)


def prompts(n, length=9, seed=1):
    import random

    rng = random.Random(seed)
    return [[rng.randrange(1, 97) for _ in range(length + i % 5)] for i in range(n)]


def run(core, ps, params=GREEDY):
    return run_requests(core, ps, params)


def test_batch_equals_alone(tiny_core):
    ps = prompts(8)
    alone = [run(tiny_core(), [p])[0] for p in ps]
    assert run(tiny_core(), ps) == alone
    assert all(len(a) == 12 for a in alone)


def test_chunked_prefill_same_output_and_budget(tiny_core):
    ps = prompts(4, length=30)
    ref = run(tiny_core(max_num_batched_tokens=512), ps)
    core = tiny_core(max_num_batched_tokens=8)
    for i, p in enumerate(ps):
        core.add_request(f"r{i}", p, GREEDY)
    out = {f"r{i}": [] for i in range(4)}
    while core.has_unfinished():
        for d in core.step():
            out[d.request_id] += d.new_token_ids
    assert [out[f"r{i}"] for i in range(4)] == ref


def test_budget_is_respected(tiny_core):
    core = tiny_core(max_num_batched_tokens=8)
    for i, p in enumerate(prompts(3, length=20)):
        core.add_request(f"r{i}", p, GREEDY)
    while core.has_unfinished():
        sched = core.scheduler.schedule()
        assert 0 < sched.num_tokens <= 8
        inp = core.runner.prepare(sched)
        reqs = [c.request for c in inp.sample_chunks]
        samples = sample(core.runner.forward(inp), reqs)
        core.scheduler.update(sched, {r.request_id: [s.token] for r, s in zip(reqs, samples)})


def test_new_requests_join_running_batch(tiny_core):
    core = tiny_core()
    core.add_request("a", prompts(1)[0], GREEDY)
    core.step()
    core.add_request("b", prompts(2)[1], GREEDY)
    core.step()
    running = {r.request_id for r in core.scheduler.running}
    assert running == {"a", "b"}


def test_preemption_keeps_output_and_frees_everything(tiny_core):
    ps = prompts(6, length=10)
    params = SamplingParams(max_tokens=20, temperature=0, ignore_eos=True)
    ref = run(tiny_core(num_kv_blocks=256), ps, params)
    core = tiny_core(num_kv_blocks=16)  # 16 blocks × 4 tokens: far less than 6 × 30 tokens
    got = run(core, ps, params)
    assert got == ref
    assert core.scheduler.num_preemptions > 0
    assert core.pool.num_used == 0 and core.pool.num_free == 16


def test_seeded_sampling_survives_preemption(tiny_core):
    ps = prompts(6, length=10)
    params = SamplingParams(max_tokens=20, temperature=1.0, seed=42, ignore_eos=True)
    ref = run(tiny_core(num_kv_blocks=256), ps, params)
    core = tiny_core(num_kv_blocks=16)
    assert run(core, ps, params) == ref
    assert core.scheduler.num_preemptions > 0


def test_abort_frees_blocks_at_once(tiny_core):
    core = tiny_core()
    core.add_request("a", prompts(1)[0], SamplingParams(max_tokens=50, temperature=0, ignore_eos=True))
    for _ in range(3):
        core.step()
    assert core.pool.num_used > 0
    core.abort("a")
    assert core.pool.num_used == 0 and not core.has_unfinished()


def test_request_that_can_never_fit_is_rejected(tiny_core):
    core = tiny_core(num_kv_blocks=4)  # 16 tokens
    with pytest.raises(CapacityError, match="KV blocks"):
        core.add_request("big", list(range(1, 30)), GREEDY)
    with pytest.raises(RequestError, match="empty"):
        core.add_request("e", [], GREEDY)


def test_max_tokens_none_runs_to_the_context_end(tiny_core):
    """max_tokens=None (vLLM's): the request generates until the context is full, finish "length"."""
    core = tiny_core(max_model_len=32)
    core.add_request("r", list(range(1, 11)), SamplingParams(max_tokens=None, temperature=0, ignore_eos=True))
    out, finish = [], None
    while core.has_unfinished():
        for d in core.step():
            out += d.new_token_ids
            finish = d.finish_reason or finish
    assert len(out) == 32 - 10 and finish == "length"


def test_prompt_longer_than_context(tiny_core):
    core = tiny_core(max_model_len=32)
    with pytest.raises(RequestError, match="context"):
        core.add_request("long", list(range(1, 40)), GREEDY)


class ChunkCounter:
    def __init__(self):
        self.tokens = {}

    def on_step(self, record):
        for rid, _, n in record.chunks:
            self.tokens[rid] = self.tokens.get(rid, 0) + n

    def on_finish(self, request):
        pass


def test_prefix_cache_computes_only_unshared_tokens(tiny_core):
    core = tiny_core(block_size=4)
    shared = prompts(1, length=20)[0]
    a, b = shared + [5, 6], shared + [7, 8, 9]
    cold = run(tiny_core(block_size=4, enable_prefix_caching=False), [b])[0]
    run(core, [a])
    core.observer = counter = ChunkCounter()
    core.add_request("b", b, GREEDY)
    out = []
    while core.has_unfinished():
        for d in core.step():
            out += d.new_token_ids
    assert out == cold
    assert core.prefix_cache.hit_tokens == 20  # 5 full blocks of the shared 20 tokens
    # prefill computed only the 3 unshared prompt tokens, then one token per decode step
    assert counter.tokens["b"] == 3 + (GREEDY.max_tokens - 1)


@pytest.mark.parametrize("itl_target_ms", [0.0, 50.0])
def test_requests_sharing_a_prompt_prefix_compute_it_once(tiny_core, itl_target_ms):
    """Requests arriving together with one prefix (n samples of a prompt, a shared system prompt): the first
    computes the shared blocks, the others wait for them in the prefix cache instead of computing them beside
    it; each output is the one it gets alone."""
    shared = prompts(1, length=30)[0]
    tails = [[5, 6], [7, 8, 9], [5, 6], [11]]
    kw = {"block_size": 4, "max_num_batched_tokens": 64, "itl_target_ms": itl_target_ms}
    alone = [run(tiny_core(**kw), [shared + t])[0] for t in tails]
    core = tiny_core(**kw)
    core.observer = counter = ChunkCounter()
    assert run(core, [shared + t for t in tails]) == alone
    computed = sum(counter.tokens.values()) - 4 * (GREEDY.max_tokens - 1)  # prompt positions computed
    assert computed == 32 + 5 + 4 + 3  # "r0" whole; the others past the 7 blocks (28 tokens) it cached
    assert core.prefix_cache.hit_tokens >= 3 * 28


def test_priority_runs_first(tiny_core):
    core = tiny_core(max_num_seqs=1)
    core.add_request("low", prompts(1)[0], GREEDY, priority=5)
    core.add_request("high", prompts(2)[1], GREEDY, priority=0)
    core.step()
    assert [r.request_id for r in core.scheduler.running] == ["high"]


def test_stop_reason_is_the_stop_token_id(tiny_core):
    """A request stopped at one of stop_token_ids reports that id as stop_reason (vLLM); EOS and length report None."""
    prompt = [5, 6, 7, 8]
    plain = run_requests(tiny_core(), [prompt], SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))[0]

    def last_delta(params, eos=()):
        core = tiny_core()
        core.add_request("r", prompt, params, eos)
        while core.has_unfinished():
            for d in core.step():
                if d.finished:
                    return d

    d = last_delta(SamplingParams(max_tokens=8, temperature=0, stop_token_ids=[plain[3]]))
    assert d.finish_reason == "stop" and d.stop_reason == plain[3] == d.new_token_ids[-1]
    d = last_delta(SamplingParams(max_tokens=8, temperature=0, stop_token_ids=[plain[3]]), eos=(plain[3],))
    assert d.finish_reason == "stop" and d.stop_reason is None  # EOS is checked first, as vLLM
    d = last_delta(SamplingParams(max_tokens=3, temperature=0))
    assert d.finish_reason == "length" and d.stop_reason is None


def test_a_request_ending_at_its_prefill_leaves_its_prompt_in_the_prefix_cache(tiny_core):
    """max_tokens=1 (a TTFT probe, a classification, prompt scoring): the prompt's blocks are cached all the same."""
    core = tiny_core(block_size=4)
    shared = prompts(1, length=20)[0]
    run(core, [shared + [5]], SamplingParams(max_tokens=1, temperature=0))
    run(core, [shared + [6, 7]])
    assert core.prefix_cache.hit_tokens == 20
