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
        self.tokenizer, self.encode = llm.tokenizer, llm.encode

    def generate(self, prompts, params):
        self.batches.append(len(prompts))
        return self.llm.generate(prompts, params)


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
    third = greedy.logprobs[0].top[2][0]  # the root's third most likely token

    def reward(r):
        return 1.0 if r.token_ids[:1] == [third] else 0.0

    res = tree_search(smollm, PROMPT, reward, levels=1, width=2, top_k=4, max_tokens=6)
    assert res.greedy.reward == 0.0 and res.best.reward == 1.0 and res.best.token_ids[0] == third
    assert smollm.core.pool.num_used == 0
