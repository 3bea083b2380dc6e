"""vLLM's /tokenize and /detokenize over the scripted model's server (SmolLM2's tokenizer; context 256)."""

from __future__ import annotations

from serverkit import SCRIPT_TEXT

CHAT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello, world!"}]


def test_tokenize_prompt(script_server, client, tokenizer):
    url = script_server[0]
    r = client.post(url + "/tokenize", json={"model": "script-model", "prompt": "Hello, world!"})
    assert r.status_code == 200, r.text
    ids = tokenizer.encode("Hello, world!")
    assert r.json() == {"count": len(ids), "max_model_len": 256, "tokens": ids, "token_strs": None}
    r = client.post(url + "/tokenize", json={"prompt": "Hello, world!", "return_token_strs": True,
                                             "add_special_tokens": False}).json()
    assert r["tokens"] == tokenizer.encode("Hello, world!", add_special_tokens=False)
    assert r["token_strs"] == ["Hello", ",", "Ġworld", "!"]  # the vocabulary's strings (vLLM's convert_ids_to_tokens)
    assert client.post(url + "/tokenize", json={"prompt": "", "return_token_strs": None}).json()["count"] == len(
        tokenizer.encode(""))


def test_tokenize_chat_is_what_chat_completions_sends(script_server, client, tokenizer):
    """messages are rendered and tokenized as /v1/chat/completions does: the count is that call's prompt_tokens."""
    url = script_server[0]
    r = client.post(url + "/tokenize", json={"messages": CHAT})
    assert r.status_code == 200, r.text
    text = tokenizer.apply_chat_template(CHAT, add_generation_prompt=True)
    assert r.json()["tokens"] == tokenizer.encode(text, add_special_tokens=False)
    used = client.post(url + "/v1/chat/completions", json={"messages": CHAT, "max_tokens": 1}).json()["usage"]
    assert r.json()["count"] == used["prompt_tokens"]
    bare = client.post(url + "/tokenize", json={"messages": CHAT, "add_generation_prompt": False}).json()
    assert 0 < bare["count"] < r.json()["count"]
    prefill = CHAT + [{"role": "assistant", "content": "Hi th"}]
    cont = client.post(url + "/tokenize", json={"messages": prefill, "add_generation_prompt": False,
                                                "continue_final_message": True}).json()
    assert tokenizer.decode(cont["tokens"], skip_special_tokens=False).endswith("assistant\nHi th")
    kw = client.post(url + "/tokenize", json={"messages": CHAT, "chat_template_kwargs": {"enable_thinking": False}})
    assert kw.json()["tokens"] == r.json()["tokens"]  # the template's variables: none of them in this one


def test_developer_messages_are_system_instructions_and_unknown_roles_refused(script_server, client):
    """OpenAI's developer role is the system's instructions: rendered as a system message (as vLLM, for templates
    without it; Qwen's would drop it). A role no template knows is a 400 naming it, not a message dropped."""
    url = script_server[0]
    system = client.post(url + "/tokenize", json={"messages": CHAT}).json()
    developer = [{"role": "developer", "content": "Be brief."}, CHAT[1]]
    assert client.post(url + "/tokenize", json={"messages": developer}).json()["tokens"] == system["tokens"]
    used = client.post(url + "/v1/chat/completions", json={"messages": developer, "max_tokens": 1}).json()["usage"]
    assert used["prompt_tokens"] == system["count"]
    wizard = [CHAT[0], {"role": "wizard", "content": "hi"}]
    for path in ("/tokenize", "/v1/chat/completions"):
        r = client.post(url + path, json={"messages": wizard, "max_tokens": 1})
        assert r.status_code == 400 and r.json()["error"]["param"] == "messages.1.role", r.text
        assert "'wizard'" in r.json()["error"]["message"]
    for role in ("user", "assistant", "tool", "function"):  # OpenAI's other roles are taken
        r = client.post(url + "/tokenize", json={"messages": [{"role": role, "content": "hi", "name": "f"}]})
        assert r.status_code == 200, r.text


def test_detokenize(script_server, client, tokenizer):
    url = script_server[0]
    ids = tokenizer.encode(SCRIPT_TEXT, add_special_tokens=False)
    r = client.post(url + "/detokenize", json={"model": "script-model", "tokens": ids})
    assert r.status_code == 200, r.text
    assert r.json() == {"prompt": SCRIPT_TEXT}
    chat = client.post(url + "/tokenize", json={"messages": CHAT}).json()["tokens"]
    rendered = client.post(url + "/detokenize", json={"tokens": chat}).json()["prompt"]
    assert rendered == tokenizer.apply_chat_template(CHAT) and "<|im_start|>" in rendered  # special tokens kept
    assert client.post(url + "/detokenize", json={"tokens": []}).json() == {"prompt": ""}
