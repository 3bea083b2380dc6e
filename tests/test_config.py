"""engine_config: LLM(...)'s keywords, ours or vLLM's names for the same things, into one EngineConfig."""

from __future__ import annotations

import pytest
import torch

from tokenhaul.config import engine_config
from tokenhaul.errors import TokenhaulError


def test_vllm_names_mean_ours():
    c = engine_config("smollm2-135m", enforce_eager=True, kv_cache_dtype="int8", dtype="auto",
                      tensor_parallel_size=1, trust_remote_code=True, max_model_len=2048)
    assert (c.compile, c.kv_dtype, c.dtype, c.max_model_len) == ("off", "int8", "bf16", 2048)
    assert engine_config("smollm2-135m", dtype="float32").torch_dtype == torch.float32
    assert engine_config("smollm2-135m", enforce_eager=False).compile == engine_config("smollm2-135m").compile


@pytest.mark.parametrize("kw,fragment", [
    (dict(tensor_parallel_size=2), "tensor_parallel_size: one engine runs on one device"),
    (dict(gpu_memory_utilization=0.9), "unknown engine argument(s) gpu_memory_utilization; choose from"),
    (dict(max_num_seq=4), "unknown engine argument(s) max_num_seq"),  # a typo is named, not a TypeError
    (dict(kv_cache_dtype="fp8"), "unknown --kv-dtype 'fp8'"),
])
def test_other_names_are_one_clear_error(kw, fragment):
    with pytest.raises(TokenhaulError) as e:
        engine_config("smollm2-135m", **kw)
    assert fragment in str(e.value) and "\n" not in str(e.value)


@pytest.mark.parametrize("kw,fragment", [
    (dict(threads=-1), "threads must be a positive number, got -1"),
    (dict(threads=0), "threads must be a positive number, got 0"),
    (dict(max_model_len=-5), "max_model_len must be a positive number, got -5"),
    (dict(num_kv_blocks=-2), "num_kv_blocks must be a positive number, got -2"),
    (dict(kv_memory_gib=-1.0), "kv_memory_gib must be a positive number, got -1.0"),
    (dict(kv_memory_gib=float("nan")), "kv_memory_gib must be a positive number, got nan"),
    (dict(block_size=0), "block_size must be a positive number, got 0"),
    (dict(max_model_len="4096"), "max_model_len must be a positive number, got '4096'"),
    (dict(threads=True), "threads must be a positive number, got True"),
])
def test_bad_sizes_are_one_clear_error(kw, fragment):
    """Refused here, before rope, the KV cache or torch.set_num_threads raise a RuntimeError on them."""
    with pytest.raises(TokenhaulError) as e:
        engine_config("smollm2-135m", **kw)
    assert fragment in str(e.value) and "\n" not in str(e.value)


def test_any_block_size_is_accepted():
    """The kernels take any block size (blocks of 16 only pick the int8-query path), so 7 is not refused."""
    assert engine_config("smollm2-135m", block_size=7).block_size == 7


def test_max_model_len_none_is_the_default():
    """vLLM's default, which ported scripts pass: the model's context (ours: 8192 at most)."""
    assert engine_config("smollm2-135m", max_model_len=None).max_model_len == 8192
