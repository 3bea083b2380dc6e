"""Tokenizer: GGUF build + cache, encode/decode, BOS, EOS ids, chat templates against transformers."""

from __future__ import annotations

import time

import pytest

from tokenhaul.errors import RequestError
from tokenhaul.models.catalog import is_installed, resolve
from tokenhaul.text import tokenizer as tokenizer_mod
from tokenhaul.text.tokenizer import Tokenizer

TEXTS = [
    "Hello world",
    " Hello  world\n\n",
    "",
    "你好 🙂 wörld — ⟁ Ꙭ",
    "def f(x):\n\treturn x**2  # ok",
    "<|im_start|>user\nhi<|im_end|>",
    "<start_of_turn>user\nhi<end_of_turn>",
]
CONVERSATION = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "Name a prime number. 🙂"},
]


def test_tiny_round_trip(tiny: Tokenizer) -> None:
    for text in ["hello world", "é😀 x", ""]:
        assert tiny.decode(tiny.encode(text)) == text
    ids = tiny.encode("a<|im_end|>b")
    assert tiny.backend.token_to_id("<|im_end|>") in ids
    assert tiny.decode(ids) == "ab"
    assert tiny.decode(ids, skip_special_tokens=False) == "a<|im_end|>b"
    assert tiny.is_special(ids[1]) and not tiny.is_special(ids[0])


def test_tiny_chat_template(tiny_factory) -> None:
    tok = tiny_factory(
        "{{ bos_token }}{% for m in messages %}{% if m.role == 'tool' %}{{ raise_exception('no tools') }}"
        "{% endif %}<{{ m.role }}>{{ m.content | tojson }}{{ eos_token }}\n{% endfor %}"
        "{% if add_generation_prompt %}<assistant>{% endif %}"
    )
    out = tok.apply_chat_template([{"role": "user", "content": "é"}])
    assert out == '<|im_start|><user>"é"<|im_end|>\n<assistant>'
    bare = tok.apply_chat_template([{"role": "user", "content": "x"}], add_generation_prompt=False)
    assert bare == '<|im_start|><user>"x"<|im_end|>\n'
    with pytest.raises(RequestError, match="no tools"):
        tok.apply_chat_template([{"role": "tool", "content": "x"}])
    prefill = [{"role": "user", "content": "x"}, {"role": "assistant", "content": "The answer is"}]
    cont = tok.apply_chat_template(prefill, add_generation_prompt=False, continue_final_message=True)
    assert cont == '<|im_start|><user>"x"<|im_end|>\n<assistant>"The answer is'  # the content's end, no end-of-turn
    with pytest.raises(RequestError, match="continue_final_message"):
        tok.apply_chat_template(prefill, continue_final_message=True)  # and add_generation_prompt (the default)


def test_template_variables_are_chat_template_kwargs(tiny_factory) -> None:
    """vLLM's chat_template_kwargs reach the template as variables; the request's own arguments stay its own."""
    tok = tiny_factory("{% if enable_thinking %}<think>{% endif %}{{ messages[0].content }}")
    user = [{"role": "user", "content": "x"}]
    assert tok.apply_chat_template(user) == "x"
    assert tok.apply_chat_template(user, variables={"enable_thinking": True}) == "<think>x"
    for taken in ("messages", "add_generation_prompt", "bos_token"):
        with pytest.raises(RequestError, match=f"chat_template_kwargs may not set {taken}"):
            tok.apply_chat_template(user, variables={taken: None})
    loops = tiny_factory("{% for t in tools %}{{ t }}{% endfor %}{{ messages[0].content }}")
    assert loops.apply_chat_template(user, variables={"tools": ["a"]}) == "ax"
    with pytest.raises(RequestError, match="chat_template_kwargs: .* TypeError"):  # a Python error in the template
        loops.apply_chat_template(user, variables={"tools": 5})


def test_tiny_sandboxed_template(tiny_factory) -> None:
    tok = tiny_factory("{{ messages.__class__.__mro__ }}")
    with pytest.raises(RequestError):
        tok.apply_chat_template([])


def test_no_template_is_a_request_error(tiny: Tokenizer) -> None:
    with pytest.raises(RequestError, match="model tiny has no chat template"):
        tiny.apply_chat_template([{"role": "user", "content": "hi"}])


@pytest.mark.real_model
def test_build_then_cached_load(tmp_path, monkeypatch) -> None:
    if not is_installed("smollm2-135m"):
        pytest.skip("smollm2-135m not installed")
    path = resolve("smollm2-135m").gguf_path
    built = Tokenizer.from_gguf(path, tmp_path)
    assert (tmp_path / "tokenizer.json").is_file() and (tmp_path / "tokenizer_meta.json").is_file()
    monkeypatch.setattr(tokenizer_mod, "_build", lambda *a: pytest.fail("rebuilt despite the cache"))
    t0 = time.perf_counter()
    cached = Tokenizer.from_gguf(path, tmp_path)
    assert time.perf_counter() - t0 < 2.0
    assert cached.meta == built.meta and cached.vocab_size == built.vocab_size
    assert cached.encode(TEXTS[3]) == built.encode(TEXTS[3])


@pytest.mark.real_model
def test_encode_matches_transformers(real_tok: Tokenizer, hf_tok) -> None:
    hf = hf_tok(real_tok.name)
    for text in TEXTS:
        assert real_tok.encode(text) == hf(text).input_ids, text
        assert real_tok.encode(text, add_special_tokens=False) == hf(text, add_special_tokens=False).input_ids


@pytest.mark.real_model
def test_round_trip_and_bos(real_tok: Tokenizer) -> None:
    expected_bos = {"smollm2-135m": False, "gemma3-270m": True, "qwen2.5-coder-0.5b": False}
    assert real_tok.add_bos is expected_bos[real_tok.name]
    for text in TEXTS[:5]:
        ids = real_tok.encode(text)
        assert (ids[:1] == [real_tok.bos_token_id]) is real_tok.add_bos
        assert real_tok.decode(ids) == text
    assert real_tok.is_special(real_tok.eos_token_ids[0])
    assert real_tok.vocab_size == {"smollm2-135m": 49152, "gemma3-270m": 262144}.get(real_tok.name, 151936)


@pytest.mark.real_model
def test_token_bytes_join_to_the_text(real_tok: Tokenizer) -> None:
    """Each id's bytes (OpenAI's logprobs `bytes`) joined give the text back, where single ids decode to U+FFFD:
    byte-level ids carrying part of an emoji, byte-fallback ids, SentencePiece's word marks, special tokens."""
    text = "Rare 𓀀ꙮ🜁, emoji 😀🎉, 中文, café — ok\n\ttabs  two spaces <|im_end|><end_of_turn>"
    ids = real_tok.encode(text, add_special_tokens=False)
    pieces = [real_tok.token_bytes(i) for i in ids]
    assert b"".join(pieces).decode() == text
    assert b"\xf0" in pieces or b"\xf0\x93" in pieces  # 𓀀 comes in pieces that decode alone to U+FFFD


@pytest.mark.real_model
def test_eos_ids(real_tok: Tokenizer) -> None:
    eot = "<end_of_turn>" if real_tok.name == "gemma3-270m" else "<|im_end|>"
    eot_id = real_tok.backend.token_to_id(eot)
    assert eot_id is not None and eot_id in real_tok.eos_token_ids
    assert len(set(real_tok.eos_token_ids)) == len(real_tok.eos_token_ids)


@pytest.mark.real_model
@pytest.mark.parametrize("alias", ["smollm2-135m", "qwen2.5-coder-0.5b"])
def test_chat_template_matches_transformers(alias: str, real_toks, hf_tok) -> None:
    tok, hf = real_toks(alias), hf_tok(alias)
    for gen in (True, False):
        for conv in (CONVERSATION, CONVERSATION[1:]):
            ours = tok.apply_chat_template(conv, add_generation_prompt=gen)
            theirs = hf.apply_chat_template(conv, add_generation_prompt=gen, tokenize=False)
            assert ours == theirs
    assert tok.apply_chat_template(CONVERSATION).endswith("<|im_start|>assistant\n")
    for prefill in ("Two, or", "Seven  \n"):  # the template keeps the spacing; strips it (transformers: cut before)
        conv = [*CONVERSATION, {"role": "assistant", "content": prefill}]
        ours = tok.apply_chat_template(conv, add_generation_prompt=False, continue_final_message=True)
        theirs = hf.apply_chat_template(conv, add_generation_prompt=False, continue_final_message=True, tokenize=False)
        assert ours == theirs and ours.rstrip().endswith(prefill.strip())


@pytest.mark.real_model
@pytest.mark.parametrize("alias", ["smollm2-135m", "qwen2.5-coder-0.5b"])
def test_a_developer_message_renders_as_a_system_one(alias: str, real_toks) -> None:
    """OpenAI's developer role is its system one, for LLM.chat as for the server (both render here); Qwen's template
    would drop the message silently."""
    tok = real_toks(alias)
    developer = [{"role": "developer", "content": "You are terse."}, *CONVERSATION[1:]]
    assert tok.apply_chat_template(developer) == tok.apply_chat_template(CONVERSATION)
    assert "You are terse." in tok.apply_chat_template(developer)

@pytest.mark.real_model
def test_gemma_has_no_chat_template(real_toks) -> None:
    with pytest.raises(RequestError, match="^model gemma3-270m has no chat template$"):
        real_toks("gemma3-270m").apply_chat_template(CONVERSATION)
