"""Incremental detokenization and stop strings, linear in the output length.

Each new token is decoded in a small window (the prefix/read offsets vLLM's detokenizer uses: the window starts a
few tokens back, so a tokenizer that merges spaces or multi-byte characters across tokens still decodes it right),
and stop strings are looked for only in the new text plus the longest stop's length before it. A 1,000-token
output therefore costs the same per token at its end as at its start.
"""
from __future__ import annotations

import re
from contextlib import nullcontext
from time import monotonic


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
    """Generated text with stop conditions applied: the text never shows a stop string or anything after it, and
    while generating, text that could be the start of a stop string is held back. Two more conditions, llama-server's
    for editors (its n_indent and t_max_predict_ms): `min_indent`, a line after the first indented by fewer spaces or
    tabs ends the text before it; `time_limit_s` after the first generated token, the text ends after its last whole
    line (or after the next newline, if none has come yet)."""

    def __init__(self, tokenizer, stops: list[str], lock=None, min_indent: int = 0,
                 time_limit_s: float | None = None, clock=monotonic):
        self.tok, self.stops, self.lock = tokenizer, stops, lock or nullcontext()
        self.min_indent, self.time_limit_s, self.clock = min_indent, time_limit_s, clock
        self.short_line = re.compile(r"\n[ \t]{0,%d}(?=[^ \t\r\n])" % (min_indent - 1)) if min_indent > 0 else None
        self.longest = max(max(map(len, stops), default=0), min_indent + 2 if min_indent else 0)
        self.started: float | None = None
        self._reset()

    @property
    def active(self) -> bool:
        return bool(self.stops or self.short_line or self.time_limit_s is not None)

    def _reset(self) -> None:
        self.inc = IncrementalText(self.decode)
        self.cut: int | None = None  # where the text ends (a stop string's start, a short line's, a line's end)
        self.cut_tokens: int | None = None  # the shortest token prefix whose text completes what ends it
        self.line_end: tuple[int, int] | None = None  # after the last newline: (text position, tokens)
        self.overdue = False  # past the time limit: the next newline ends the text

    def decode(self, ids) -> str:
        with self.lock:
            return self.tok.decode(ids, skip_special_tokens=True)

    def _first_stop(self, text: str) -> int | None:
        """Where the text ends within `text`: a stop string's start, or a short line's (after its newline)."""
        hits = [i for i in (text.find(s) for s in self.stops) if i >= 0]
        if self.short_line is not None and (m := self.short_line.search(text)) is not None:
            hits.append(m.start() + 1)
        return min(hits) if hits else None

    def _feed(self, ids: list[int]) -> None:
        """Take the ids not seen yet, one at a time, looking for a stop in each new piece (plus the longest stop's
        length of text before it, where a stop can begin)."""
        for k in range(len(self.inc.ids), len(ids)):
            start = max(0, len(self.inc.text) - self.longest + 1)
            piece = self.inc.push(ids[k])
            if piece and (self.stops or self.short_line) and self.cut is None:
                hit = self._first_stop(self.inc.text[start:])
                if hit is not None:
                    self.cut, self.cut_tokens = start + hit, k + 1
                    return
            if "\n" in piece:
                newline = len(self.inc.text) - len(piece) + piece.index("\n") + 1
                if self.overdue:  # the first newline past the time limit ends the text
                    self.cut, self.cut_tokens = newline, k + 1
                    return
                self.line_end = (len(self.inc.text) - len(piece) + piece.rindex("\n") + 1, k + 1)

    def stop_check(self, ids: list[int]) -> int | None:
        """How many tokens to keep: the shortest prefix whose text completes a stop (None: no stop yet)."""
        if self.cut is None:
            self._feed(ids)
        if self.cut is None and self.time_limit_s is not None and ids:
            now = self.clock()
            if self.started is None:
                self.started = now
            elif now - self.started > self.time_limit_s:
                self.overdue = True
                if self.line_end is not None:
                    self.cut, self.cut_tokens = self.line_end
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
            start = max(0, len(self.inc.text) - self.longest + 1)
            hit = self._first_stop(text[start:]) if self.stops or self.short_line else None
            return text if hit is None else text[: start + hit]
        hold = max((n for s in self.stops for n in range(1, len(s)) if text.endswith(s[:n])), default=0)
        if self.short_line is not None:  # a line's indentation so far, shorter than the least: it may end the text
            tail = text[text.rfind("\n") + 1:] if "\n" in text else None
            if tail is not None and len(tail) < self.min_indent and not tail.strip(" \t"):
                hold = max(hold, len(tail))
        return text[: len(text) - hold]
