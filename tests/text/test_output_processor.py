"""OutputProcessor: the text of a request's output as the core's token-id deltas arrive."""

from __future__ import annotations

import pytest

from tokenhaul.engine.messages import RequestDelta, Sample
from tokenhaul.outputs import TokenLogprob
from tokenhaul.sampling_params import SamplingParams
from tokenhaul.text.output_processor import OutputProcessor
from tokenhaul.text.tokenizer import Tokenizer


def feed(tok: Tokenizer, params: SamplingParams, ids: list[int], finish_reason: str | None,
         sizes: list[int] | None = None, stop_reason: int | None = None):
    """Send ids as the core would (chunks of `sizes`, one by one by default), the last delta finishing
    with finish_reason (None: the request is still running). The output, and the ids the front end
    asked to abort."""
    proc = OutputProcessor(tok)
    proc.add("r", tok.encode("hi"), params)
    sizes, i, aborted = list(sizes or []), 0, []
    while i < len(ids):
        n = sizes.pop(0) if sizes else 1
        chunk, i = ids[i:i + n], i + n
        last = i >= len(ids) and finish_reason is not None
        _, stopped = proc.process([RequestDelta("r", chunk, last, finish_reason if last else None,
                                                [Sample(t, -1.0) for t in chunk],
                                                stop_reason=stop_reason if last else None)])
        aborted += stopped
    return proc.release("r"), aborted


@pytest.mark.parametrize("include", [False, True])
def test_stop_token_text_dropped_unless_included(tiny: Tokenizer, include: bool) -> None:
    ids = tiny.encode("hello world")
    params = SamplingParams(stop_token_ids=[ids[-1]], include_stop_str_in_output=include)
    out, _ = feed(tiny, params, ids, "stop", stop_reason=ids[-1])
    assert out.token_ids == ids and out.finish_reason == "stop" and out.stop_reason == ids[-1]  # the id (vLLM)
    assert out.text == ("hello world" if include else "hello")


@pytest.mark.parametrize("skip", [False, True])
@pytest.mark.parametrize("include", [False, True])
def test_eos_text_follows_the_same_rule(tiny: Tokenizer, skip: bool, include: bool) -> None:
    ids = tiny.encode("ab<|im_end|>")
    params = SamplingParams(skip_special_tokens=skip, include_stop_str_in_output=include)
    out, _ = feed(tiny, params, ids, "stop")
    assert out.token_ids == ids
    assert out.text == ("ab<|im_end|>" if include and not skip else "ab")


def test_stop_token_id_not_at_a_stop_keeps_its_text(tiny: Tokenizer) -> None:
    """A stop-token id in the middle (ignore_eos), or the last token of a length finish, is ordinary text."""
    ids = tiny.encode("a<|im_end|>b<|im_end|>")
    out, _ = feed(tiny, SamplingParams(ignore_eos=True, skip_special_tokens=False), ids, "length")
    assert out.text == "a<|im_end|>b<|im_end|>"


@pytest.mark.parametrize("sizes", [[3, 5, 4], [20], [1, 7, 2]])
def test_drafts_past_a_stop_string_are_not_output(tiny: Tokenizer, sizes: list[int]) -> None:
    """Verified drafts arrive several per delta: token_ids, logprobs and text end where one-by-one decoding's do."""
    ids = tiny.encode("hello world and more")
    params = SamplingParams(stop=["o w"], logprobs=0)
    plain, plain_abort = feed(tiny, params, ids, None)
    out, aborted = feed(tiny, params, ids, None, sizes)
    assert plain.text == out.text == "hell" and out.stop_reason == "o w" and aborted == plain_abort == ["r"]
    assert out.token_ids == plain.token_ids == ids[:len(tiny.encode("hello w"))]
    assert [lp.token_id for lp in out.logprobs] == out.token_ids


def test_abort_releases_text_held_for_a_stop_string(tiny: Tokenizer) -> None:
    """A request ended from outside (a deadline, a client gone) ends at no stop string: the text held back as a
    possible stop-string prefix is released as the last delta, as at a length finish."""
    ids = tiny.encode("hello wor")
    proc = OutputProcessor(tiny)
    proc.add("r", tiny.encode("hi"), SamplingParams(stop=["world peace"]))
    proc.process([RequestDelta("r", ids, False, None, [Sample(t) for t in ids])])
    shown = proc.outputs["r"].text
    assert "hello wor".startswith(shown) and shown != "hello wor"  # "wor" may start the stop string: held
    out = proc.abort("r")
    assert out.finished and out.finish_reason == "abort" and out.stop_reason is None
    assert out.text == "hello wor" and out.delta_text == "hello wor"[len(shown):]


def test_prompt_logprobs_arrive_once_and_stay(tiny: Tokenizer) -> None:
    """The core sends prompt logprobs in a request's first delta: the output holds them (None for the first
    prompt token), later deltas leave them; a request that did not ask has none."""
    prompt = tiny.encode("hi there")
    proc = OutputProcessor(tiny)
    proc.add("r", prompt, SamplingParams(prompt_logprobs=1))
    proc.add("q", prompt, SamplingParams())
    sent = [None] + [Sample(t, -0.5 * i, [(7, -0.1)]) for i, t in enumerate(prompt[1:], 1)]
    proc.process([RequestDelta("r", [5], False, None, [Sample(5)], prompt_logprobs=sent),
                  RequestDelta("q", [5], False, None, [Sample(5)])])
    proc.process([RequestDelta("r", [6], True, "length", [Sample(6)])])
    out = proc.release("r")
    assert out.prompt_logprobs == [None] + [TokenLogprob(t, -0.5 * i, [(7, -0.1)])
                                            for i, t in enumerate(prompt[1:], 1)]
    assert len(out.prompt_logprobs) == len(prompt) > 1 and out.token_ids == [5, 6]
    assert proc.release("q").prompt_logprobs is None
