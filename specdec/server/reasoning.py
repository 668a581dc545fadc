"""A thinking model's reasoning apart from its answer (Qwen3, QwQ, DeepSeek-R1 and its distills): the text between
`<think>` and `</think>` goes to the message's `reasoning_content` (the field llama-server, vLLM and DeepSeek's API
use), the rest to `content`.

It applies where the chat template writes `<think>` (`thinks`), to answers that open with the tag, or, where the
prompt itself ends inside one (R1's templates end the generation prompt with `<think>\\n`), from the first token.
Streamed, a chunk that may be the start of a tag is held until the next says (`ReasoningSplit.feed`). The
reasoning is stripped of the whitespace around it, the answer of the whitespace before it; an answer that does not
open with `<think>` is left as it is.
"""
from __future__ import annotations

from ..thinking import CLOSE, OPEN, opens_inside, thinks

__all__ = ["CLOSE", "OPEN", "opens_inside", "thinks"]  # (and what follows)
FORMATS = ("auto", "deepseek", "none")  # llama-server's reasoning_format names; deepseek is auto here


class ReasoningSplit:
    """One answer's text, fed as it streams -> (reasoning, content) deltas."""

    def __init__(self, inside: bool):
        self.state = "reasoning" if inside else "start"
        self.reasoned = inside  # the answer had reasoning (then the message carries reasoning_content)
        self.buf = ""  # text not yet given out
        self.started = False  # some reasoning was given out (its leading whitespace is dropped before)

    def feed(self, text: str, final: bool = False) -> tuple[str, str]:
        self.buf += text
        reasoning = content = ""
        while True:
            if self.state == "start":  # nothing given out yet: does the answer open with the tag?
                head = self.buf.lstrip()
                if head.startswith(OPEN):
                    self.buf, self.state, self.reasoned = head[len(OPEN):], "reasoning", True
                    continue
                if not final and OPEN.startswith(head):
                    return reasoning, content  # whitespace or a part of the tag so far
                self.state = "content"  # an answer without reasoning: left as it is
            elif self.state == "reasoning":
                end = self.buf.find(CLOSE)
                if end >= 0:
                    reasoning += self._reason(self.buf[:end].rstrip())
                    self.buf, self.state = self.buf[end + len(CLOSE):], "gap"
                    continue
                held = 0 if final else _held(self.buf)
                reasoning += self._reason(self.buf[:len(self.buf) - held].rstrip() if final else
                                          self.buf[:len(self.buf) - held])
                self.buf = self.buf[len(self.buf) - held:]
                return reasoning, content
            elif self.state == "gap":  # after the closing tag: the whitespace before the answer is dropped
                head = self.buf.lstrip()
                if not head:
                    self.buf = ""
                    return reasoning, content
                self.buf, self.state = head, "content"
            else:
                content, self.buf = content + self.buf, ""
                return reasoning, content

    def _reason(self, text: str) -> str:
        if not self.started:
            text = text.lstrip()
            self.started = bool(text)
        return text


def _held(text: str) -> int:
    """Characters at the end of `text` that may still begin the closing tag: whitespace, then a proper prefix of
    it (the whitespace is dropped should the tag follow)."""
    tag = next(k for k in range(len(CLOSE) - 1, -1, -1) if text.endswith(CLOSE[:k]))
    body = text[:len(text) - tag]
    return tag + len(body) - len(body.rstrip())


def split(text: str, inside: bool) -> tuple[str | None, str]:
    """A whole answer -> (its reasoning, or None where it has none; its content)."""
    s = ReasoningSplit(inside)
    reasoning, content = s.feed(text, final=True)
    return (reasoning if s.reasoned else None), content


def reasoning_tokens(tokenizer, token_ids: list[int], text: str, inside: bool) -> int:
    """How many of an answer's tokens wrote its reasoning, the tags included (usage's reasoning_tokens): the fewest
    leading tokens whose text reaches the end of `</think>`, or all of them if the reasoning never closed; 0 for an
    answer without reasoning."""
    s = ReasoningSplit(inside)
    s.feed(text, final=True)
    if not s.reasoned:
        return 0
    head = len(text) - len(text.lstrip()) if not inside else 0
    end = text.find(CLOSE, head)
    if end < 0:
        return len(token_ids)
    end += len(CLOSE)
    lo, hi = 0, len(token_ids)  # the fewest tokens whose decoded text is at least `end` characters long
    while lo < hi:
        mid = (lo + hi) // 2
        if len(tokenizer.decode(token_ids[:mid])) >= end:
            hi = mid
        else:
            lo = mid + 1
    return lo


def count(decoder, results: list, inside: list[bool] | None) -> int | None:
    """The reasoning tokens of several answers (results in job order, `inside` each one's start), or None where
    nothing is split."""
    if inside is None:
        return None
    with decoder.tokenizer_lock:
        return sum(reasoning_tokens(decoder.tokenizer, r.token_ids, r.text, i) for r, i in zip(results, inside))
