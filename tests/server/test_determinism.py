"""--deterministic on the real model at its default settings (bf16, packed weights): the same chat
request at temperature 0 gives the same text cold and warm (prefix cache), streamed and not, alone and
among 19 others — for 20 prompts including CJK and emoji."""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
from serverkit import MODEL, ServerThread

from tokenhaul.config import EngineConfig
from tokenhaul.engine.core import EngineCore
from tokenhaul.server.app import build_app
from tokenhaul.server.async_engine import AsyncEngine

PROMPTS = [
    "What is a KV cache?", "Write a haiku about autumn.", "用一句话介绍长城。", "Explain recursion to a child.",
    "Translate 'good morning' into French and Spanish.", "def fibonacci(n):", "List three uses of copper.",
    "东京和京都有什么不同？", "Why is the sky blue?", "Tell me a joke about cats 🐱.", "What does 🚀 usually mean?",
    "Summarise: the quick brown fox jumps over the lazy dog.", "Give me a Python one-liner to reverse a list.",
    "How many legs does a spider have?", "写一首关于月亮的短诗。", "Name the planets of the solar system.",
    "What is 17 times 23?", "Describe the smell of rain 🌧️.", "SELECT * FROM users WHERE", "Why do we sleep?",
]


@pytest.mark.real_model
def test_same_text_cold_warm_streamed_and_batched():
    from tokenhaul.llm import LLM

    llm = LLM(MODEL, deterministic=True)  # default dtype and quantization: the path users run
    cfg = EngineConfig(model=MODEL, num_kv_blocks=512, max_num_seqs=32, deterministic=True)
    engine = AsyncEngine(EngineCore(cfg, llm.model), llm.tokenizer, MODEL)
    with ServerThread(build_app(engine)) as srv, httpx.Client(timeout=300.0) as c:
        url = srv.url + "/v1/chat/completions"

        def body(p: str) -> dict:
            return {"model": MODEL, "messages": [{"role": "user", "content": p}], "max_tokens": 24,
                    "temperature": 0, "seed": 1}

        def chat_plain(p: str) -> str:
            r = c.post(url, json=body(p))
            assert r.status_code == 200, r.text
            return r.json()["choices"][0]["message"]["content"]

        def chat_stream(p: str) -> str:
            text = ""
            with c.stream("POST", url, json=body(p) | {"stream": True}) as r:
                assert r.status_code == 200
                for ln in r.iter_lines():
                    if ln.startswith("data: {"):
                        for ch in json.loads(ln[6:])["choices"]:
                            text += ch["delta"].get("content") or ""
            return text

        cold = [chat_plain(p) for p in PROMPTS]  # each alone, cache cold for its own prompt
        warm = [chat_stream(p) for p in PROMPTS]  # each alone again: prefix-cache hit, streamed
        with ThreadPoolExecutor(20) as pool:  # all at once, streamed and not mixed: chunks split anew
            batched = list(pool.map(lambda ip: (chat_stream if ip[0] % 2 else chat_plain)(ip[1]), enumerate(PROMPTS)))
    assert all(cold)
    assert warm == cold
    assert batched == cold


@pytest.mark.real_model
def test_greedy_speculation_gives_plain_greedys_tokens():
    """Under --deterministic a verify step's rows get the bits a decode would: prompt lookup and Jacobi give
    plain greedy's tokens and logprobs on the real model, where the default bf16 kernels let them part (the
    compiled lone decode against eager verify rows)."""
    from tokenhaul import LLM, SamplingParams

    llm = LLM(MODEL, deterministic=True)
    prompts = ["def fib(n):\n    if n < 2:\n        return n\n    return fib(n - 1) + fib(n - 2)\n\ndef fib2(n):\n",
               "The cat sat on the mat. The cat sat on the mat. The dog", "用一句话介绍长城。用一句话介绍长城。"]

    def run(speculative: str) -> list[list[tuple[int, float]]]:
        sp = SamplingParams(max_tokens=32, temperature=0, ignore_eos=True, logprobs=0, speculative=speculative)
        return [[(t, o.outputs[0].logprobs[i][t].logprob) for i, t in enumerate(o.outputs[0].token_ids)]
                for o in llm.generate(prompts, sp)]

    plain = run("off")
    assert run("prompt_lookup") == plain
    assert run("jacobi") == plain
