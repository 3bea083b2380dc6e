"""Detokenizer: streamed deltas equal the one-shot decode, stay UTF-8 whole, and honour stop strings.

Definitions the properties check (T = tokenizer.decode(ids), the one-shot text):
- token boundary: len(decode(ids[:k])) for any k where decode(ids[:k]) is a prefix of T;
- stop match: the occurrence of any stop string in T that ends first (ties: earlier start);
  output = T before it (through it with include_stop_str_in_output), or T if none occurs.
"""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tokenhaul.text.detokenizer import Detokenizer
from tokenhaul.text.tokenizer import Tokenizer

MULTIBYTE = ["é", "ß", "你好", "😀", "🙂", "⟁", "Ꙭ", "👩‍💻", "e\u0301", "𝔘𝔫", "\u200b"]
PROPERTY = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def _byte_level_map() -> dict[int, str]:
    """GPT-2's byte → printable-char table used by byte-level BPE vocabularies."""
    bs = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    cs, n = bs[:], 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, map(chr, cs), strict=True))


BYTE_LEVEL = _byte_level_map()


def byte_token(tok: Tokenizer, b: int) -> int:
    piece = f"<0x{b:02X}>" if tok.byte_fallback_ids else BYTE_LEVEL[b]
    token_id = tok.backend.token_to_id(piece)
    assert token_id is not None, piece
    return token_id


def run(det: Detokenizer, ids: list[int], sizes: list[int] | None = None) -> list[str]:
    """Push ids in chunks (one by one by default), then flush; the list of deltas."""
    deltas, i, sizes = [], 0, list(sizes or [])
    while i < len(ids):
        n = max(1, sizes.pop(0) if sizes else 1)
        deltas.append(det.push(ids[i : i + n]))
        i += n
    return [*deltas, det.flush()]


def boundaries(tok: Tokenizer, ids: list[int], skip: bool) -> set[int]:
    full = tok.decode(ids, skip_special_tokens=skip)
    prefixes = (tok.decode(ids[:k], skip_special_tokens=skip) for k in range(len(ids) + 1))
    return {len(p) for p in prefixes if full.startswith(p)}


def expected_stop(text: str, stops: list[str], include: bool) -> tuple[str, str | None]:
    best = min(((text.find(s) + len(s), text.find(s), s) for s in stops if s and s in text), default=None)
    if best is None:
        return text, None
    end, start, stop = best
    return text[: end if include else start], stop


def offsets(deltas: list[str]) -> list[int]:
    out, n = [], 0
    for d in deltas:
        n += len(d)
        out.append(n)
    return out


@st.composite
def token_ids(draw: st.DrawFn, tok: Tokenizer, max_len: int = 40) -> list[int]:
    """Random ids mixed with byte tokens that split multi-byte characters and encoded real text."""
    segment = st.one_of(
        st.lists(st.integers(0, tok.vocab_size - 1), max_size=6),
        st.builds(
            lambda t, a, b: t.encode()[a:b], st.sampled_from(MULTIBYTE), st.integers(0, 3), st.integers(1, 12)
        ).map(lambda bs: [byte_token(tok, b) for b in bs]),
        st.text(max_size=10).map(lambda s: tok.encode(s, add_special_tokens=False)),
        st.sampled_from(sorted(tok.special_ids)[:50]).map(lambda i: [i]),
    )
    parts = draw(st.lists(segment, max_size=8))
    return [i for part in parts for i in part][:max_len]


# ---- tiny tokenizer: exact examples ------------------------------------------------------------


def test_split_emoji_waits_for_whole_char(tiny: Tokenizer) -> None:
    ids = tiny.encode("é😀!")
    assert len(ids) == 7
    det = Detokenizer(tiny, [])
    assert run(det, ids) == ["", "é", "", "", "", "😀", "!", ""]
    assert det.text == "é😀!" and det.token_count == 7


def test_flush_releases_incomplete_bytes_as_decode_does(tiny: Tokenizer) -> None:
    ids = tiny.encode("a😀")[:-1]
    det = Detokenizer(tiny, [])
    assert run(det, ids) == ["a", "", "", "", tiny.decode(ids)[1:]]
    assert det.text == tiny.decode(ids) == "a\ufffd"


def test_stop_across_tokens(tiny: Tokenizer) -> None:
    det = Detokenizer(tiny, [], stop=["lo w"])
    deltas = run(det, tiny.encode("hello world and more"))
    assert "".join(deltas) == det.text == "hel"
    assert det.stopped and det.stop_reason == "lo w"
    assert det.push(tiny.encode(" more")) == "" and det.flush() == ""


def test_min_tokens_counts_only_stops_ending_past_them(tiny: Tokenizer) -> None:
    """vLLM's min_tokens: a stop string ending in the text of the first min_tokens tokens is no stop; one ending
    later is, even where it starts earlier."""
    ids = tiny.encode("hello world")  # h e l l o ' world'
    for min_tokens, stop, want in [(0, "l", "he"), (3, "l", "hel"), (5, "l", "hello wor"), (5, "lo w", "hel"),
                                   (6, "l", "hello world")]:
        det = Detokenizer(tiny, [], stop=[stop], min_tokens=min_tokens)
        assert "".join(run(det, ids)) == det.text == want, (min_tokens, stop)
        assert det.stopped == (want != "hello world")


def test_include_stop_and_earliest_end(tiny: Tokenizer) -> None:
    det = Detokenizer(tiny, [], stop=["world", "o w"], include_stop_str_in_output=True)
    run(det, tiny.encode("hello world"))
    assert det.text == "hello w" and det.stop_reason == "o w"


def test_held_text_released_whole_tokens(tiny: Tokenizer) -> None:
    ids = tiny.encode("hello world")  # h e l l o ' world'
    det = Detokenizer(tiny, [], stop=["ld!", "xyz"])
    deltas = run(det, ids)
    assert deltas == ["h", "e", "", "l", "lo", "", " world"]  # "l" may start "ld!"
    assert not det.stopped and det.stop_reason is None


def test_prompt_ending_mid_char_does_not_merge(tiny: Tokenizer) -> None:
    e_acute = tiny.encode("é")
    det = Detokenizer(tiny, tiny.encode("hi") + e_acute[:1])
    gen = e_acute[1:] + tiny.encode("x")
    assert "".join(run(det, gen)) == tiny.decode(gen) == "\ufffdx"


def test_specials_skipped_or_shown(tiny: Tokenizer) -> None:
    ids = tiny.encode("a<|im_end|>b")
    assert "".join(run(Detokenizer(tiny, [], skip_special_tokens=False), ids)) == "a<|im_end|>b"
    assert "".join(run(Detokenizer(tiny, [1]), ids)) == "ab"


def test_empty_stops_are_ignored(tiny: Tokenizer) -> None:
    det = Detokenizer(tiny, [], stop=["", "zzz"])
    assert "".join(run(det, tiny.encode("hello"))) == "hello" and not det.stopped


def test_long_stream_trims_its_window(tiny: Tokenizer) -> None:
    ids = tiny.encode("é world " * 200)
    det = Detokenizer(tiny, [])
    assert "".join(run(det, ids)) == tiny.decode(ids)
    assert len(det._ids) < 300


# ---- real vocabularies: properties -------------------------------------------------------------


@pytest.mark.real_model
@PROPERTY
@given(data=st.data())
def test_stream_equals_one_shot(real_tok: Tokenizer, data: st.DataObject) -> None:
    tok = real_tok
    skip = data.draw(st.booleans(), label="skip_special_tokens")
    prompt = data.draw(token_ids(tok, max_len=10), label="prompt")
    ids = data.draw(token_ids(tok), label="ids")
    sizes = data.draw(st.lists(st.integers(1, 4), max_size=len(ids)), label="chunk sizes")
    full = tok.decode(ids, skip_special_tokens=skip)
    det = Detokenizer(tok, prompt, skip_special_tokens=skip)
    deltas = run(det, ids, sizes)
    assert "".join(deltas) == det.text == full
    for delta, end in zip(deltas, offsets(deltas), strict=True):
        start = end - len(delta)
        assert all(full[start + j] == "\ufffd" for j, ch in enumerate(delta) if ch == "\ufffd")
    assert set(offsets(deltas)) <= boundaries(tok, ids, skip)
    assert det.token_count == len(ids)


@pytest.mark.real_model
@PROPERTY
@given(data=st.data())
def test_text_is_emitted_as_soon_as_it_is_whole(real_tok: Tokenizer, data: st.DataObject) -> None:
    """One id per push: once decode(ids[:k]) ends in a whole char (and no byte run is open), it is out."""
    tok = real_tok
    skip = data.draw(st.booleans(), label="skip_special_tokens")
    ids = data.draw(token_ids(tok), label="ids")
    full = tok.decode(ids, skip_special_tokens=skip)
    det = Detokenizer(tok, [], skip_special_tokens=skip)
    for k, token_id in enumerate(ids, start=1):
        det.push([token_id])
        visible = [i for i in ids[:k] if not (skip and tok.is_special(i))]
        open_run = bool(visible) and visible[-1] in tok.byte_fallback_ids
        prefix = tok.decode(ids[:k], skip_special_tokens=skip)
        if not open_run and not prefix.endswith("\ufffd"):
            assert det.text == prefix, k
        assert full.startswith(det.text)


@pytest.mark.real_model
@PROPERTY
@given(data=st.data())
def test_stop_strings(real_tok: Tokenizer, data: st.DataObject) -> None:
    tok = real_tok
    ids = data.draw(token_ids(tok), label="ids")
    full = tok.decode(ids)
    slices = st.tuples(st.integers(0, len(full)), st.integers(1, 6)).map(lambda t: full[t[0] : t[0] + t[1]])
    stops = data.draw(st.lists(st.one_of(slices, st.text(min_size=1, max_size=3)), max_size=3), label="stops")
    include = data.draw(st.booleans(), label="include_stop_str_in_output")
    sizes = data.draw(st.lists(st.integers(1, 3), max_size=len(ids)), label="chunk sizes")
    want, reason = expected_stop(full, stops, include)
    det = Detokenizer(tok, [], stop=stops, include_stop_str_in_output=include)
    deltas = run(det, ids, sizes)
    assert "".join(deltas) == det.text == want
    assert det.stop_reason == reason and det.stopped is (reason is not None)
    if not include:
        assert not any(s and s in det.text for s in stops)
    cuts = [e for e in offsets(deltas) if reason is None or e != len(want)]  # only a stop may split a token
    assert set(cuts) <= boundaries(tok, ids, True)
