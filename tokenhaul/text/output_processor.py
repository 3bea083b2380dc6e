"""OutputProcessor: the front end's half of the engine loop. Token-id deltas from the core become
text deltas (one Detokenizer per request); stop strings finish requests, which the caller must then
abort in the core. It never touches tensors.

A request the core stopped at a stop token (EOS unless ignore_eos, or one of stop_token_ids) keeps
the token in token_ids but not its text, unless include_stop_str_in_output (as vLLM). Speculation's
verified drafts arrive several at a time; token_ids end, as in plain decoding, at the token that
completed a stop string."""

from __future__ import annotations

import time

from tokenhaul.engine.messages import RequestDelta
from tokenhaul.outputs import BeamOutput, RequestOutput, TokenLogprob
from tokenhaul.sampling_params import SamplingParams
from tokenhaul.text.detokenizer import Detokenizer
from tokenhaul.text.tokenizer import Tokenizer


class OutputProcessor:
    def __init__(self, tokenizer: Tokenizer, ledger=None) -> None:
        self.tokenizer = tokenizer
        self.ledger = ledger
        self.outputs: dict[str, RequestOutput] = {}
        self._detok: dict[str, Detokenizer] = {}
        self._params: dict[str, SamplingParams] = {}
        self._stop_ids: dict[str, frozenset[int]] = {}

    def add(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams) -> RequestOutput:
        out = RequestOutput(request_id, list(prompt_token_ids))
        if params.logprobs is not None:
            out.logprobs = []
        self.outputs[request_id] = out
        self._params[request_id] = params
        self._stop_ids[request_id] = self._silent_stop_ids(params)
        self._detok[request_id] = Detokenizer(self.tokenizer, prompt_token_ids, params.stop,
                                              params.skip_special_tokens, params.include_stop_str_in_output,
                                              params.min_tokens) if params.detokenize else _NoText()
        return out

    def process(self, deltas: list[RequestDelta], step: int = -1) -> tuple[list[RequestOutput], list[str]]:
        """Apply one step's deltas. Returns (updated outputs, request ids stopped by a stop string —
        the caller aborts those in the core)."""
        updated, to_abort = [], []
        for d in deltas:
            out = self.outputs.get(d.request_id)
            if out is None or out.finished:
                continue
            t0 = time.perf_counter()
            detok = self._detok[d.request_id]
            stop_ids = self._stop_ids[d.request_id]
            if d.beams is not None:
                skip = self._params[d.request_id].skip_special_tokens
                out.beams = [BeamOutput(b.token_ids, self.tokenizer.decode(_text_ids(b.token_ids, stop_ids),
                                                                           skip_special_tokens=skip),
                                        b.score, b.finish_reason, b.stop_reason) for b in d.beams]
            if d.prompt_logprobs is not None:
                out.prompt_logprobs = [None if s is None else TokenLogprob(s.token, s.logprob, s.top_logprobs, s.rank)
                                       for s in d.prompt_logprobs]
            t1 = time.perf_counter()
            new = d.new_token_ids
            text, taken = detok.push_until_stop(_text_ids(new, stop_ids) if d.finish_reason == "stop" else new)
            if detok.stopped:
                new = new[:taken]  # verified drafts past the token that completed the stop string: never output
                out.finished, out.finish_reason, out.stop_reason = True, "stop", detok.stop_reason
                if not d.finished:
                    to_abort.append(d.request_id)
            elif d.finished:
                text += detok.flush()
                out.finished, out.finish_reason, out.stop_reason = True, d.finish_reason, d.stop_reason
            t2 = time.perf_counter()
            out.token_ids += new
            if out.logprobs is not None:
                out.logprobs += [TokenLogprob(s.token, s.logprob, s.top_logprobs, s.rank) for s in d.samples[:len(new)]]
            out.text += text
            out.delta_text = text
            if self.ledger is not None:  # detokenize: push/flush; deliver: the rest of this body
                n = max(1, len(new))  # verified drafts arrive together: one event per token
                detok_s, deliver_s = (t2 - t1) / n, (time.perf_counter() - t0 - (t2 - t1)) / n
                for _ in range(n):
                    self.ledger.on_token(d.request_id, step, detok_s, deliver_s)
            updated.append(out)
            if out.finished:
                self._drop(d.request_id)
        return updated, to_abort

    def abort(self, request_id: str, reason: str = "abort") -> RequestOutput | None:
        """Finish a request the core did not finish (deadline, client gone). Text held back as a possible
        stop-string prefix was no stop string: it is released, as at any end but a stop string's (delta_text)."""
        out = self.outputs.get(request_id)
        if out is not None and not out.finished:
            text = self._detok[request_id].flush()
            out.text += text
            out.delta_text = text
            out.finished, out.finish_reason = True, reason
            self._drop(request_id)
        return out

    def release(self, request_id: str) -> RequestOutput | None:
        """Forget a request (finished or not) and return its output; the caller owns it from now on."""
        self._drop(request_id)
        return self.outputs.pop(request_id, None)

    def _silent_stop_ids(self, params: SamplingParams) -> frozenset[int]:
        """The stop tokens whose text a stop leaves out (none with include_stop_str_in_output)."""
        if params.include_stop_str_in_output:
            return frozenset()
        eos = () if params.ignore_eos else self.tokenizer.eos_token_ids
        return frozenset(params.stop_token_ids).union(eos)

    def _drop(self, request_id: str) -> None:
        self._detok.pop(request_id, None)
        self._params.pop(request_id, None)
        self._stop_ids.pop(request_id, None)


def _text_ids(ids: list[int], stop_ids: frozenset[int]) -> list[int]:
    """The ids of a sequence that ended at a stop whose text shows: all but a final stop token."""
    return ids[:-1] if ids and ids[-1] in stop_ids else ids


class _NoText:
    """The Detokenizer of a request with detokenize=False (vLLM's): no text, so no stop string ever matches."""

    stopped = False
    stop_reason = None

    def push_until_stop(self, ids: list[int]) -> tuple[str, int]:
        return "", len(ids)

    def flush(self) -> str:
        return ""
