"""Detokenizer: one per request; generated ids in, UTF-8-safe text deltas out, stop strings held back.

Incremental decoding uses the prefix/read-offset method (as in vLLM): each step decodes only a
short window, `decode(window + new) - decode(window)`, and emits nothing while the text ends in an
incomplete character (U+FFFD) or in a byte-fallback token (whose run may still grow).

Stop rule: the match is the stop-string occurrence in the decoded text that ends first (ties: the
one that starts first, i.e. the longest); output is the text before it (through it with
`include_stop_str_in_output`), and nothing after it is ever emitted. With `min_tokens` (vLLM's), a stop
string counts only where it ends in the text of a token past the first min_tokens.
"""

from __future__ import annotations

from tokenhaul.text.tokenizer import Tokenizer

SEED_TOKENS = 6  # prompt tokens kept as decoding context, so the first delta decodes as in the sequence
_TRIM_AT = 256  # drop consumed ids from the window list past this many


class Detokenizer:
    """Turns one request's generated token ids into text deltas; `push` per step, `flush` at the end.

    Invariants: `text` is the concatenation of every delta returned; a delta ends on a token
    boundary unless it ends at a matched stop string; after `stopped` nothing more is emitted.
    """

    def __init__(
        self,
        tokenizer: Tokenizer,
        prompt_token_ids: list[int],
        stop: list[str] | None = None,
        skip_special_tokens: bool = True,
        include_stop_str_in_output: bool = False,
        min_tokens: int = 0,
    ) -> None:
        self._backend = tokenizer.backend
        self._byte_ids = tokenizer.byte_fallback_ids
        self._special = tokenizer.special_ids
        self._skip = skip_special_tokens
        self._in_byte_run = False  # the last id the decoder sees is a byte-fallback token
        self._stops = tuple(s for s in dict.fromkeys(stop or ()) if s)
        self._max_stop = max(map(len, self._stops), default=0)
        self._include_stop = include_stop_str_in_output
        self._min_tokens = min_tokens
        self._stops_from: int | None = 0 if min_tokens == 0 else None  # where a stop may end (chars); None: not yet
        seed = self._clean_seed(prompt_token_ids)
        # window: ids[prefix:read] decoded to prefix_text was the last emitted group; ids[read:] pending
        self._ids = seed
        self._prefix, self._read = 0, len(seed)
        self._prefix_text = self._decode(seed)
        self._held = ""  # decoded, not yet emitted: it may start a stop string
        self._held_cuts: list[int] = []  # token-group ends inside _held, ascending, last == len(_held)
        self.text = ""
        self.token_count = 0
        self.stopped = False
        self.stop_reason: str | None = None

    def push(self, token_ids: list[int]) -> str:
        """Feed newly generated ids; return the text now safe to emit ('' if none). Mutates self."""
        if self.stopped or not token_ids:
            return ""
        self.token_count += len(token_ids)
        self._ids.extend(token_ids)
        if self._byte_ids and self._ends_in_byte_run(token_ids):
            return ""  # the decoder fuses a run of byte tokens as one: wait for the run to end
        text = self._decode(self._ids[self._prefix :])
        if len(text) <= len(self._prefix_text) or text.endswith("\ufffd"):
            return ""
        return self._emit(self._advance(text), final=False)

    def push_until_stop(self, token_ids: list[int]) -> tuple[str, int]:
        """`push` the ids one at a time, as plain decoding would, while a stop string may end among them:
        (the text, how many ids were taken — all, or those through the one that completed a stop)."""
        if not self._stops or len(token_ids) < 2:
            return self.push(token_ids), len(token_ids)
        text = ""
        for k, t in enumerate(token_ids, 1):
            text += self.push([t])
            if self.stopped:
                return text, k
        return text, len(token_ids)

    def flush(self) -> str:
        """End of generation: release held text and pending ids (incomplete bytes decode as U+FFFD)."""
        if self.stopped:
            return ""
        chunk = ""
        if len(self._ids) > self._read:
            chunk = self._advance(self._decode(self._ids[self._prefix :]))
        return self._emit(chunk, final=True)

    def _clean_seed(self, prompt_token_ids: list[int]) -> list[int]:
        """The prompt tail as context, or none if it ends mid-character (it would merge with the output)."""
        seed = list(prompt_token_ids[-SEED_TOKENS:])
        if seed and (self._ends_in_byte_run(seed) or self._decode(seed).endswith("\ufffd")):
            self._in_byte_run = False
            return []
        return seed

    def _ends_in_byte_run(self, token_ids: list[int]) -> bool:
        """Track whether the last id the decoder sees (skipped specials are invisible) is a byte token."""
        for t in token_ids:
            if not (self._skip and t in self._special):
                self._in_byte_run = t in self._byte_ids
        return self._in_byte_run

    def _decode(self, ids: list[int]) -> str:
        return self._backend.decode(ids, skip_special_tokens=self._skip)

    def _advance(self, text: str) -> str:
        """Take the new text of the window; pending ids become the next prefix group."""
        delta = text[len(self._prefix_text) :]
        self._prefix, self._read = self._read, len(self._ids)
        self._prefix_text = self._decode(self._ids[self._prefix :])
        if self._prefix > _TRIM_AT:
            del self._ids[: self._prefix]
            self._read -= self._prefix
            self._prefix = 0
        return delta

    def _emit(self, chunk: str, final: bool) -> str:
        """Pass a whole-token chunk through the stop-string check; return what may be emitted now."""
        if not self._stops:
            self.text += chunk
            return chunk
        if self._stops_from is None and self.token_count > self._min_tokens:  # this chunk is past min_tokens
            self._stops_from = len(self.text) + len(self._held)
        buf = self._held + chunk
        cuts = self._held_cuts + [len(buf)] if chunk else self._held_cuts
        match = None if self._stops_from is None else self._find_stop(buf, self._stops_from - len(self.text))
        if match is not None:
            start, stop = match
            out = buf[: start + len(stop) if self._include_stop else start]
            self.stopped, self.stop_reason = True, stop
            self._held, self._held_cuts = "", []
        elif final:
            out, self._held, self._held_cuts = buf, "", []
        else:
            hold_from = self._hold_from(buf)
            cut = max((c for c in cuts if c <= hold_from), default=0)
            out, self._held = buf[:cut], buf[cut:]
            self._held_cuts = [c - cut for c in cuts if c > cut]
        self.text += out
        return out

    def _find_stop(self, buf: str, end_after: int) -> tuple[int, str] | None:
        """(start, stop) of the occurrence in buf ending past index end_after that ends first; ties go to the
        earlier start."""
        best: tuple[int, int, str] | None = None
        for stop in self._stops:
            i = buf.find(stop, max(0, end_after - len(stop) + 1))
            if i >= 0 and (best is None or (i + len(stop), i) < best[:2]):
                best = (i + len(stop), i, stop)
        return None if best is None else (best[1], best[2])

    def _hold_from(self, buf: str) -> int:
        """Smallest index whose suffix could still grow into a stop string (len(buf) if none)."""
        n = len(buf)
        for k in range(max(0, n - self._max_stop + 1), n):
            tail = buf[k:]
            if any(stop.startswith(tail) for stop in self._stops):
                return k
        return n
