"""OutputProcessor: the front end's half of the engine loop. Token-id deltas from the core become
text deltas (one Detokenizer per request); stop strings finish requests, which the caller must then
abort in the core. It never touches tensors."""

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

    def add(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams) -> RequestOutput:
        out = RequestOutput(request_id, list(prompt_token_ids))
        if params.logprobs is not None:
            out.logprobs = []
        self.outputs[request_id] = out
        self._params[request_id] = params
        self._detok[request_id] = Detokenizer(self.tokenizer, prompt_token_ids, params.stop,
                                              params.skip_special_tokens, params.include_stop_str_in_output)
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
            out.token_ids += d.new_token_ids
            if out.logprobs is not None:
                out.logprobs += [TokenLogprob(s.token, s.logprob, s.top_logprobs) for s in d.samples]
            if d.beams is not None:
                skip = self._params[d.request_id].skip_special_tokens
                out.beams = [BeamOutput(ids, self.tokenizer.decode(ids, skip_special_tokens=skip), score)
                             for ids, score in d.beams]
            t1 = time.perf_counter()
            text = detok.push(d.new_token_ids)
            if detok.stopped:
                out.finished, out.finish_reason, out.stop_reason = True, "stop", detok.stop_reason
                if not d.finished:
                    to_abort.append(d.request_id)
            elif d.finished:
                text += detok.flush()
                out.finished, out.finish_reason = True, d.finish_reason
            t2 = time.perf_counter()
            out.text += text
            out.delta_text = text
            if self.ledger is not None:  # detokenize: push/flush; deliver: the rest of this body
                n = max(1, len(d.new_token_ids))  # verified drafts arrive together: one event per token
                detok_s, deliver_s = (t2 - t1) / n, (time.perf_counter() - t0 - (t2 - t1)) / n
                for _ in range(n):
                    self.ledger.on_token(d.request_id, step, detok_s, deliver_s)
            updated.append(out)
            if out.finished:
                self._drop(d.request_id)
        return updated, to_abort

    def abort(self, request_id: str, reason: str = "abort") -> RequestOutput | None:
        out = self.outputs.get(request_id)
        if out is not None and not out.finished:
            out.finished, out.finish_reason = True, reason
            self._drop(request_id)
        return out

    def release(self, request_id: str) -> RequestOutput | None:
        """Forget a request (finished or not) and return its output; the caller owns it from now on."""
        self._drop(request_id)
        return self.outputs.pop(request_id, None)

    def _drop(self, request_id: str) -> None:
        self._detok.pop(request_id, None)
        self._params.pop(request_id, None)
