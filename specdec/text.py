"""Incremental detokenization and stop strings, linear in the output length.

Each new token is decoded in a small window (the prefix/read offsets vLLM's detokenizer uses: the window starts a
few tokens back, so a tokenizer that merges spaces or multi-byte characters across tokens still decodes it right),
and stop strings are looked for only in the new text plus the longest stop's length before it. A 1,000-token
output therefore costs the same per token at its end as at its start (benchmarks/stop_cost.py).
"""
from __future__ import annotations

from contextlib import nullcontext


class IncrementalText:
    """The text of a growing list of token ids, one token at a time."""

    def __init__(self, decode):
        self.decode, self.ids, self.text = decode, [], ""
        self.prefix = self.read = 0  # ids[prefix:read] is the context the next piece is decoded after

    def push(self, token: int) -> str:
        """Append a token; return the text it completes ("" while a multi-byte character is unfinished)."""
        self.ids.append(token)
        before = self.decode(self.ids[self.prefix:self.read])
        after = self.decode(self.ids[self.prefix:])
        if len(after) > len(before) and not after.endswith("\ufffd"):
            piece = after[len(before):]
            self.prefix, self.read = self.read, len(self.ids)
            self.text += piece
            return piece
        return ""

    def pending(self) -> str:
        """Text held back at the end (an unfinished character), for the final flush."""
        return self.decode(self.ids[self.prefix:])[len(self.decode(self.ids[self.prefix:self.read])):]


class StopText:
    """Generated text with stop strings applied: the text never shows a stop string or anything after it, and while
    generating, text that could be the start of a stop string is held back."""

    def __init__(self, tokenizer, stops: list[str], lock=None):
        self.tok, self.stops, self.lock = tokenizer, stops, lock or nullcontext()
        self.longest = max(map(len, stops), default=0)
        self._reset()

    def _reset(self) -> None:
        self.inc = IncrementalText(self.decode)
        self.cut: int | None = None  # where the first stop string starts in the text
        self.cut_tokens: int | None = None  # the shortest token prefix whose text completes it

    def decode(self, ids) -> str:
        with self.lock:
            return self.tok.decode(ids, skip_special_tokens=True)

    def _first_stop(self, text: str) -> int | None:
        hits = [i for i in (text.find(s) for s in self.stops) if i >= 0]
        return min(hits) if hits else None

    def _feed(self, ids: list[int]) -> None:
        """Take the ids not seen yet, one at a time, looking for a stop in each new piece (plus the longest stop's
        length of text before it, where a stop can begin)."""
        for k in range(len(self.inc.ids), len(ids)):
            start = max(0, len(self.inc.text) - self.longest + 1)
            if self.inc.push(ids[k]) and self.stops and self.cut is None:
                hit = self._first_stop(self.inc.text[start:])
                if hit is not None:
                    self.cut, self.cut_tokens = start + hit, k + 1
                    return

    def stop_check(self, ids: list[int]) -> int | None:
        """How many tokens to keep: the shortest prefix whose text completes a stop string (None: no stop yet)."""
        if self.cut is None:
            self._feed(ids)
        return self.cut_tokens

    def visible(self, ids: list[int], final: bool) -> str:
        if len(ids) < len(self.inc.ids):  # tokens seen by stop_check were cut (token budget): decode again, once
            self._reset()
        if self.cut is None:
            self._feed(ids)
        if self.cut is not None:
            return self.inc.text[: self.cut]
        text = self.inc.text
        if final:
            text += self.inc.pending()
            hit = self._first_stop(text[max(0, len(self.inc.text) - self.longest + 1):]) if self.stops else None
            return text if hit is None else text[: max(0, len(self.inc.text) - self.longest + 1) + hit]
        hold = max((n for s in self.stops for n in range(1, len(s)) if text.endswith(s[:n])), default=0)
        return text[: len(text) - hold]
