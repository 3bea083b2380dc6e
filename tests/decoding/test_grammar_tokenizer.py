"""GrammarCompiler's llguidance token table: built from the token strings (not by llguidance reading the whole
tokenizer.json again), it is the one llguidance's own reader builds — same bytes and special marks for every id,
same tokenization (but for text spelling a special token: text here, the special token there, which left
the matcher failed), same allowed-token masks step by step on SmolLM2 — and it is built once per compiler, not per
request. Byte-level and byte-fallback vocabularies both; tokenizers the table does not read take llguidance's
reader."""

import pytest
import torch
from tokenizers import AddedToken, Tokenizer, decoders, models, normalizers, pre_tokenizers

from tokenhaul.decoding import grammar
from tokenhaul.decoding.grammar import GrammarCompiler, _json_tokenizer, _token_table
from tokenhaul.errors import RequestError
from tokenhaul.structured_outputs import StructuredOutputsParams

SCHEMA = {"type": "object", "additionalProperties": False, "required": ["name", "age", "tags"],
          "properties": {"name": {"type": "string", "maxLength": 20}, "age": {"type": "integer"},
                         "tags": {"type": "array", "items": {"enum": ["a b", "ünï", "x"]}}}}
CASES = [  # (constraint, a text it accepts: its tokens are fed one by one)
    (dict(json=SCHEMA), '{"name": "Zoë  d\'Arc", "age": 42, "tags": ["a b", "ünï"]}'),
    (dict(json=SCHEMA, disable_any_whitespace=True), '{"name":"Bob","age":7,"tags":[]}'),
    (dict(json_object=True), '{"k": [1, -2.5, null, "\\n é"], "z": {}}'),
    (dict(regex=r"(\d{3}-){2}\d{4} [A-Z][a-z]+"), "555-123-4567 Smith"),
    (dict(choice=["yes", "no", "maybe not", "日本語"]), "maybe not"),
    (dict(grammar='start: "SELECT " COL (", " COL)* " FROM t"\nCOL: /[a-z_]+/'), "SELECT a_b, c FROM t"),
]
TEXTS = ["hello world", "  two  spaces\n\ttab", "ünïcödé 日本語 🙂", '{"a": [1, 2]}', "<|im_end|> <eos> x",
         "word" * 30, ""]


def same_table(new, old) -> None:
    V = old.vocab_size
    assert new.vocab_size == V and new.eos_tokens == old.eos_tokens and new.is_canonical == old.is_canonical
    ids = list(range(V))
    assert [new.decode_bytes([i]) for i in ids] == [old.decode_bytes([i]) for i in ids]
    assert [new.is_special_token(i) for i in ids] == [old.is_special_token(i) for i in ids]
    specials = [i for i in ids if old.is_special_token(i)]
    assert [new.dbg_tokens([i]) for i in specials] == [old.dbg_tokens([i]) for i in specials]  # their names


def same_tokens(new, old, text: str) -> None:
    """new tokenizes text as llguidance's reader does, except that text spelling a special token stays text."""
    ids, ref = new.tokenize_str(text), old.tokenize_str(text)
    assert not any(map(new.is_special_token, ids))
    if any(map(old.is_special_token, ref)):
        assert new.decode_bytes(ids) == text.encode()
    else:
        assert ids == ref


def masks(tok, spec: str, ids: list[int]) -> list[bytes]:
    """The allowed-token bitmask before each of ids, feeding them one by one, then the one after the last."""
    m = grammar.LLMatcher(tok, spec, log_level=0)
    assert not m.is_error(), m.get_error()
    row = torch.zeros(-(-tok.vocab_size // 32), dtype=torch.int32)
    out = []
    for t in [*ids, None]:
        m.unsafe_compute_mask_ptr(row.data_ptr(), row.numel() * 4)
        out.append(row.numpy().tobytes())
        if t is not None:
            assert (row[t // 32] >> (t % 32)) & 1, f"token {t} not allowed"
            assert m.consume_token(t)
    return out


@pytest.mark.real_model
@pytest.mark.parametrize("extra", [0, 64], ids=["vocab", "model-vocab-larger"])
def test_smollm2_table_is_llguidance_readers(tokenizer, extra):
    V = tokenizer.vocab_size + extra
    assert _token_table(tokenizer.backend, V) is not None  # not llguidance's reader: that is the reference
    new = GrammarCompiler.for_tokenizer(tokenizer, V).tokenizer()
    old = _json_tokenizer(tokenizer.backend, V, tokenizer.eos_token_ids)
    same_table(new, old)
    for text in TEXTS:
        same_tokens(new, old, text)


@pytest.mark.real_model
@pytest.mark.parametrize("kw, text", CASES, ids=[next(iter(kw)) for kw, _ in CASES])
def test_smollm2_masks_are_llguidance_readers(tokenizer, kw, text):
    V = tokenizer.vocab_size
    compiler = GrammarCompiler.for_tokenizer(tokenizer, V)
    old = _json_tokenizer(tokenizer.backend, V, tokenizer.eos_token_ids)
    spec = StructuredOutputsParams(**kw).spec
    ids = tokenizer.encode(text, add_special_tokens=False)
    assert masks(compiler.tokenizer(), spec, ids) == masks(old, spec, ids)


@pytest.mark.real_model
def test_smollm2_table_is_built_once_per_compiler(tokenizer, monkeypatch):
    built = []
    real = grammar.LLTokenizer
    monkeypatch.setattr(grammar, "LLTokenizer", lambda *a, **kw: built.append(1) or real(*a, **kw))
    compiler = GrammarCompiler.for_tokenizer(tokenizer, tokenizer.vocab_size)
    compiler.warm()
    assert len(built) == 1
    for kw, _ in CASES * 2:
        compiler.compile(StructuredOutputsParams(**kw))
    compiler.warm()
    assert len(built) == 1


def test_table_is_built_once_and_loaded_once():
    loads = []

    def load():
        loads.append(1)
        return byte_fallback_tokenizer(), [2]

    compiler = GrammarCompiler(load, 300)
    for _ in range(3):
        compiler.compile(StructuredOutputsParams(regex="[a-c]+"))
    assert len(loads) == 1 and compiler.tokenizer() is compiler.tokenizer()


def byte_fallback_tokenizer(prepend: bool = False) -> Tokenizer:
    """Gemma's kind: SentencePiece-style BPE, '▁' for spaces, <0xAB> byte tokens, added tokens special, <...>
    and plain."""
    vocab = {"<pad>": 0, "<unk>": 1, "<eos>": 2} | {f"<0x{b:02X}>": 3 + b for b in range(256)}
    vocab |= {w: 259 + i for i, w in enumerate(["▁", "a", "b", "c", "▁a", "ab", "▁ab", "é", "▁é", "c▁"])}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[("▁", "a"), ("a", "b"), ("▁", "ab"), ("▁", "é")],
                               unk_token="<unk>", byte_fallback=True))
    norm = [normalizers.Replace(" ", "▁")]
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), *norm] if prepend else norm)
    tok.pre_tokenizer = pre_tokenizers.Split(" ", "merged_with_previous")
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()])
    tok.add_special_tokens([AddedToken("<pad>", special=True), AddedToken("<eos>", special=True),
                            AddedToken("<start_of_turn>", special=True)])
    tok.add_tokens([AddedToken("<mark>", special=False), AddedToken("plain words", special=False)])
    return tok


def byte_level_tokenizer() -> Tokenizer:
    """SmolLM2's kind, with an added token that has a character outside the byte-level alphabet."""
    vocab = {"<|endoftext|>": 0, "Ġ": 1, "a": 2, "b": 3, "Ġa": 4, "ab": 5, "Ã©": 6, "ĠÃ©": 7, "ĉ": 8, "Ċ": 9}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[("Ġ", "a"), ("a", "b"), ("Ġ", "Ã©")]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken("<|endoftext|>", special=True), AddedToken("<|im_end|>", special=True)])
    tok.add_tokens([AddedToken("naïve ☃", special=False), AddedToken("<tag>", special=False)])
    return tok


@pytest.mark.parametrize("make, eos, extra", [(byte_fallback_tokenizer, [2], 0), (byte_fallback_tokenizer, [2, 261], 5),
                                              (byte_level_tokenizer, [0], 0), (byte_level_tokenizer, [0, 10], 3)])
def test_small_tables_are_llguidance_readers(make, eos, extra):
    backend = make()
    V = backend.get_vocab_size(with_added_tokens=True) + extra
    assert _token_table(backend, V) is not None
    new = GrammarCompiler(lambda: (backend, eos), V).tokenizer()
    old = _json_tokenizer(backend, V, eos)
    same_table(new, old)
    for text in ["a ab  é c", "plain words <mark> naïve ☃", "abc\n\t", "<eos>"]:
        same_tokens(new, old, text)
    spec = StructuredOutputsParams(regex="(a|b| )+é").spec
    ids = backend.encode("ab a é", add_special_tokens=False).ids
    assert masks(new, spec, ids) == masks(old, spec, ids)


def test_a_tokenizer_llguidance_would_change_takes_its_reader():
    backend = byte_fallback_tokenizer(prepend=True)  # llguidance's reader drops the Prepend normalizer
    assert _token_table(backend, 300) is None
    compiler = GrammarCompiler(lambda: (backend, [2]), 300)
    assert compiler.tokenizer().tokenize_str(" ab") == _json_tokenizer(backend, 300, [2]).tokenize_str(" ab")
    compiler.compile(StructuredOutputsParams(choice=["ab", "c"]))


@pytest.mark.parametrize("change, words", [("decoder", "can't determine decoder type"),
                                           ("vocab", "it has 272 tokens, the model 100")])
def test_a_tokenizer_llguidance_cannot_take_refuses_requests_not_the_load(change, words):
    backend = byte_fallback_tokenizer()
    if change == "decoder":
        backend.decoder = decoders.WordPiece()
    compiler = GrammarCompiler(lambda: (backend, [2]), 100 if change == "vocab" else 300)
    compiler.warm()  # at model load: no error
    with pytest.raises(RequestError, match=f"^structured outputs need the model's tokenizer: .*{words}") as e:
        compiler.compile(StructuredOutputsParams(choice=["ab"]))
    assert "\n" not in str(e.value)


@pytest.mark.real_model
@pytest.mark.parametrize("kw, text", [
    (dict(choice=["<|im_start|>hello"]), "<|im_start|>hello"),
    (dict(regex=r"x<\|im_end\|>y"), "x<|im_end|>y"),
    (dict(json={"type": "object", "properties": {"t": {"const": "<|im_start|>ok"}}, "required": ["t"],
                "additionalProperties": False}, disable_any_whitespace=True), '{"t":"<|im_start|>ok"}'),
], ids=["choice", "regex", "json"])
def test_text_spelling_a_special_token_is_generated_as_text(tokenizer, kw, text):
    """A constraint whose text spells a special token: the grammar's text is forced as plain tokens (llguidance's
    reader forced the special token itself, which its table marks as matching nothing: the matcher failed)."""
    g = GrammarCompiler.for_tokenizer(tokenizer, tokenizer.vocab_size).compile(StructuredOutputsParams(**kw))
    row = torch.zeros(-(-tokenizer.vocab_size // 32), dtype=torch.int32)
    out = []
    while not g.complete and len(out) < 40:  # the longest allowed token each step: the forced text's tokens
        g.fill_bitmask(row)
        allowed = ((row[:, None] >> torch.arange(32)) & 1).flatten().nonzero().flatten().tolist()
        allowed = [t for t in allowed if t < tokenizer.vocab_size and t not in tokenizer.eos_token_ids]
        out.append(max(allowed, key=lambda t: len(tokenizer.decode([t], skip_special_tokens=False))))
        g.accept(out[-1])
        assert not g.failed, g.matcher.get_error()
    assert g.complete and tokenizer.decode(out, skip_special_tokens=False) == text
    assert tokenizer.decode(out) == text  # no special token among them
