"""The server's own counters agree with what the API reports (over the scripted model, fast)."""

from __future__ import annotations

import httpx
import pytest
from serverkit import wait_idle

USER = [{"role": "user", "content": "hi"}]


def generated(client: httpx.Client, url: str) -> float:
    line = next(ln for ln in client.get(url + "/metrics").text.splitlines()
                if ln.startswith("tokenhaul_generation_tokens_total "))
    return float(line.split()[1])


@pytest.mark.parametrize("path,body", [
    ("/v1/completions", {"prompt": "Hello", "n": 3, "temperature": 1.0, "seed": 1}),
    ("/v1/completions", {"prompt": ["Hello", "Bye"], "n": 2, "use_beam_search": True, "beam_width": 3}),
    ("/v1/chat/completions", {"messages": USER, "n": 2, "use_beam_search": True, "beam_width": 3}),
])
def test_generation_tokens_count_every_choice(script_server, client, path, body):
    """tokenhaul_generation_tokens counts the completion tokens of every returned choice, as usage does: n sampled
    choices, or each of a beam search's n best beams (it counted only the best beam's)."""
    url, engine, _ = script_server
    wait_idle(engine)
    before = generated(client, url)
    r = client.post(url + path, json=body | {"max_tokens": 5, "ignore_eos": True})
    assert r.status_code == 200, r.text
    choices, used = len(r.json()["choices"]), r.json()["usage"]["completion_tokens"]
    prompts = len(body["prompt"]) if isinstance(body.get("prompt"), list) else 1
    assert choices == body["n"] * prompts and used == 5 * choices
    wait_idle(engine)
    assert generated(client, url) - before == used
