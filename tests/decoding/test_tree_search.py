"""Tree search on the real SmolLM2 (fp32): the first rollout is plain greedy, each level's rollouts run
as one batch on distinct paths, a reward steers the search off the greedy path, and no block leaks."""

import pytest

from tokenhaul.decoding.tree_search import tree_search
from tokenhaul.sampling_params import SamplingParams

pytestmark = pytest.mark.real_model
PROMPT = "The capital of France is"


class CountingLLM:
    """The LLM with its generate calls recorded (how many prompts each batch held)."""

    def __init__(self, llm):
        self.llm, self.batches = llm, []
        self.tokenizer, self.encode, self.core = llm.tokenizer, llm.encode, llm.core

    def generate(self, prompts, params, **kv):
        self.batches.append(len(prompts))
        return self.llm.generate(prompts, params, **kv)


def test_greedy_first_batched_levels_distinct_paths(smollm):
    llm = CountingLLM(smollm)
    res = tree_search(llm, PROMPT, levels=2, width=3, top_k=3, max_tokens=8)
    greedy = smollm.generate(PROMPT, SamplingParams(max_tokens=8, temperature=0))[0]
    assert res.greedy.token_ids == greedy.token_ids and res.greedy.level == 0
    assert llm.batches == [1, 3, 3]  # the root's greedy rollout, then one batch per level
    ran = [r for r in res.rollouts if r.level >= 0]
    assert len({tuple(r.token_ids) for r in ran}) == len(ran) == 7
    assert res.root.visits == len(res.rollouts)  # every reward was backed up to the root
    assert res.best.reward >= res.greedy.reward  # default reward: mean logprob
    assert smollm.core.pool.num_used == 0


def test_reward_steers_off_the_greedy_path(smollm):
    greedy = smollm.generate(PROMPT, SamplingParams(max_tokens=6, temperature=0, logprobs=4))[0]
    third, = (t for t, v in greedy.outputs[0].logprobs[0].items() if v.rank == 3)  # the root's third most likely

    def reward(r):
        return 1.0 if r.token_ids[:1] == [third] else 0.0

    res = tree_search(smollm, PROMPT, reward, levels=1, width=2, top_k=4, max_tokens=6)
    assert res.greedy.reward == 0.0 and res.best.reward == 1.0 and res.best.token_ids[0] == third
    assert smollm.core.pool.num_used == 0


class ForkWatchingLLM(CountingLLM):
    """Right after each batch (the rollouts' KV still held): the blocks each rollout shares with the one
    it forked from, their reference counts, and the prompt tokens the batch computed."""

    def __init__(self, llm):
        super().__init__(llm)
        self.shared, self.prompt_tokens = [], []

    def generate(self, prompts, params, fork_from=None, keep_kv=None):
        outs = super().generate(prompts, params, fork_from=fork_from, keep_kv=keep_kv)
        ref = self.core.pool.ref
        for src, dst in zip(fork_from, keep_kv):
            if src is not None:
                self.shared.append([(b, ref[b]) for b in dst.block_ids if b in src.block_ids])
        self.prompt_tokens.append(outs[0].ledger.summary()["prompt_tokens"])
        return outs


def test_branches_share_prefix_blocks_by_fork_and_every_block_comes_back():
    """No prefix cache: a branch's rollout forks the blocks of the rollout it branches off (shared,
    reference count >= 2 while both are held) and computes only its own first token; afterwards the
    pool is full again."""
    from tokenhaul.llm import LLM

    llm = ForkWatchingLLM(LLM("smollm2-135m", dtype="fp32", enable_prefix_caching=False, block_size=4,
                              kv_memory_gib=0.05))
    prompt = "Here is a list of the capital cities of some European countries. The capital of France is"
    res = tree_search(llm, prompt, levels=2, width=3, top_k=3, max_tokens=8)
    n_prompt = len(llm.encode(prompt))
    assert llm.batches == [1, 3, 3]
    assert llm.prompt_tokens == [n_prompt, 3, 3]  # each branch computed one token of its "prompt"
    assert res.computed_prompt_tokens == n_prompt + 6 and res.prompt_tokens > 7 * n_prompt
    assert len(llm.shared) == 6
    for blocks in llm.shared:
        assert len(blocks) >= n_prompt // 4  # at least the prompt's full blocks
        assert all(r >= 2 for _, r in blocks)
    assert len({tuple(r.token_ids) for r in res.rollouts if r.level >= 0}) == 7
    pool = llm.core.pool
    assert pool.num_free == pool.num_blocks and not any(pool.ref)
