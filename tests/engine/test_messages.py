"""The front end ↔ core boundary: torch-free messages, and the core's stats() / limits()."""

import pickle
import subprocess
import sys

from tokenhaul.engine.messages import AddRequest, CoreOutputs, RequestDelta, Sample
from tokenhaul.sampling_params import SamplingParams


def test_messages_and_clients_import_without_torch():
    code = ("import sys, tokenhaul.engine.messages, tokenhaul.engine.client, tokenhaul.cluster.router; "
            "print('torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_messages_round_trip_through_pickle():
    out = CoreOutputs(3, [RequestDelta("a", [5], True, "stop", [Sample(5, -0.5, [(5, -0.5), (7, -1.0)])])],
                      [("b", "engine error")])
    assert pickle.loads(pickle.dumps(out)) == out
    add = AddRequest("a", [1, 2], SamplingParams(max_tokens=3, temperature=0), (2,))
    assert pickle.loads(pickle.dumps(add)) == add


def test_stats_and_limits_follow_the_core(tiny_core):
    core = tiny_core(num_kv_blocks=11, block_size=4, max_model_len=64)
    lim = core.limits()
    assert (lim.max_model_len, lim.block_size, lim.num_blocks) == (64, 4, 11)
    assert lim.vocab_size == core.model.config.vocab_size
    assert core.stats().kv_blocks_total == 11 and core.stats().num_waiting == 0
    greedy = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
    core.add_request("r0", list(range(1, 10)), greedy)
    assert core.stats().num_waiting == 1 and core.request_ids() == ["r0"]
    core.step()
    s = core.stats()
    assert (s.num_running, s.num_waiting, s.num_steps, s.kv_blocks_used) == (1, 0, 1, 3)
    while core.has_unfinished():
        core.step()
    core.add_request("r1", list(range(1, 10)), greedy)  # same prompt: its two full blocks are cached
    while core.has_unfinished():
        core.step()
    s = core.stats()
    assert (s.num_running, s.kv_blocks_used, s.prefix_query_tokens, s.prefix_hit_tokens) == (0, 0, 18, 8)
