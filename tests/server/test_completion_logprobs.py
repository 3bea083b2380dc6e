"""/v1/completions' logprobs object built from the engine's rows: top_logprobs keyed by token text, where several
tokens may share a text (byte fragments all decode to "\ufffd")."""

from __future__ import annotations

from tokenhaul.server.completions import CompletionsHandler, _TextOffsets


def fragments(handler: CompletionsHandler, count: int) -> list[int]:
    """The first `count` token ids whose text alone is the replacement character (bytes of a UTF-8 character)."""
    ids = [t for t in range(1000) if handler.token_text(t) == "\ufffd"]
    assert len(ids) >= count
    return ids[:count]


def test_top_logprobs_keep_the_best_of_tokens_sharing_a_text(script_server):
    """Tokens sharing a text give one top_logprobs entry holding the most likely one's logprob: a lower top entry
    does not overwrite a higher one, nor does the sampled token (added only where its text is absent, as vLLM)."""
    engine = script_server[1]
    handler = CompletionsHandler(engine)
    a, b, sampled = fragments(handler, 3)
    word = next(t for t in range(1000) if handler.token_text(t).strip().isalpha())
    top = [(a, -0.5), (word, -0.9), (b, -1.0)]
    lp = handler._completion_logprobs([(sampled, -3.0, top, handler.token_bytes(sampled))], _TextOffsets(1), 0)
    assert lp["tokens"] == ["\ufffd"] and lp["token_logprobs"] == [-3.0]
    assert lp["top_logprobs"] == [{"\ufffd": -0.5, handler.token_text(word): -0.9}]
    # the sampled token's text absent from the k best: added with its own logprob (k + 1 entries)
    lp = handler._completion_logprobs([(sampled, -3.0, [(word, -0.9)], b"")], _TextOffsets(1), 0)
    assert lp["top_logprobs"] == [{handler.token_text(word): -0.9, "\ufffd": -3.0}]
