"""`suffix`: suffix decoding (SuffixDecoding, Oliaro et al. 2024, arXiv 2411.04975; vLLM's `method: "suffix"`).
The longest suffix of the context that occurred before, in this request's prompt and output or in what the server
generated for earlier requests (a bounded store, least recently used first out), and what followed it there.

The draft is long when the match is: up to MATCH_FACTOR tokens per matched token, at most MAX_DEPTH, and sized on
the target's measured pass curve and this request's running acceptance (`depth(cost)`, as the prediction drafter
is), so that an edit that copies the prompt drafts 16 tokens a pass while a chat with nothing to copy drafts
none. Model-free: q is one-hot, and a proposal costs a few numpy scans.
"""
from __future__ import annotations

from collections import OrderedDict

import numpy as np

from .base import Draft

MIN_MATCH = 2  # a single matching token is right too rarely to pay for rows (as ngram's min_ngram)
MAX_MATCH = 64  # the longest context suffix looked up
MAX_DEPTH = 32  # the most tokens one proposal carries
MATCH_FACTOR = 2.0  # draft tokens allowed per matched token (SuffixDecoding's max_spec_factor)
PRIOR = 0.6  # acceptance assumed before this request's first verification
STORE_TOKENS = 1 << 20  # earlier outputs kept for every request to draw from


class OutputStore:
    """Outputs of earlier requests, searched when a request's own context has no long match: one array with a
    separator between outputs, rebuilt when outputs join or leave (least recently used leave first, past
    STORE_TOKENS). Shared by every fork of a drafter (all of a server's requests)."""

    def __init__(self, limit: int = STORE_TOKENS):
        self.limit, self.outputs, self.tokens = limit, OrderedDict(), 0
        self._flat, self._owner = np.empty(0, np.int64), np.empty(0, np.int64)

    def add(self, output: list[int]) -> None:
        if len(output) < MIN_MATCH + 1:
            return
        key = tuple(output)
        if key in self.outputs:
            self.outputs.move_to_end(key)
            return
        self.outputs[key] = None
        self.tokens += len(key)
        while self.tokens > self.limit and len(self.outputs) > 1:
            self.tokens -= len(self.outputs.popitem(last=False)[0])
        self._flat = None

    def flat(self) -> np.ndarray:
        """All outputs, each followed by -1 (no token: a match never runs across two outputs)."""
        if self._flat is None:
            parts = [np.asarray(o + (-1,), np.int64) for o in self.outputs]
            self._flat = np.concatenate(parts) if parts else np.empty(0, np.int64)
        return self._flat


def longest_match(hay: np.ndarray, tail: np.ndarray, end: int) -> tuple[int, int]:
    """(length, start of what followed) of the longest suffix of `tail` (at least MIN_MATCH tokens) occurring in
    hay[:end] with a token after it, its latest occurrence; (0, -1) when none."""
    if len(tail) < MIN_MATCH or end <= MIN_MATCH:
        return 0, -1
    n = MIN_MATCH
    span = hay[:end]
    match = span[: end - n] == tail[-n]
    for j in range(1, n):
        match &= span[j: end - n + j] == tail[-n + j]
    hits = np.flatnonzero(match)  # starts i of tail[-n:] with a follower (i + n < end)
    while len(hits):
        best = (n, int(hits[-1]) + n)
        if n == len(tail):
            return best
        n += 1
        hits = hits[hits >= 1] - 1  # extend one token to the left
        hits = hits[span[hits] == tail[-n]]
        if not len(hits):
            return best
    return 0, -1


class SuffixDrafter:
    name = "suffix"
    free = True
    sizes_own_depth = True  # the engines ask it for depth(cost) tokens, not τ

    def __init__(self, store: OutputStore | None = None):
        self.store = store if store is not None else OutputStore()
        self.reset()

    def reset(self) -> None:
        """A new request: the last one's output joins the store for later requests."""
        if getattr(self, "_base", None) is not None:
            self.store.add(self._context[self._base:])
        self._base = None  # context length at the first proposal: the output starts there
        self._context: list[int] = []
        self.hits, self.tries = PRIOR * 4, 4.0  # accepted / proposed, a prior worth four drafts
        self._match = 0  # the last proposal's match length
        self._last = 0  # the last proposal's length

    def fork(self) -> SuffixDrafter:
        return SuffixDrafter(self.store)  # one store; this request's own state

    def close(self) -> None:
        """The request is over (a batch's fork leaves): its output joins the store."""
        self.reset()

    def acceptance(self) -> float:
        return min(0.99, self.hits / self.tries)

    def depth(self, cost) -> int:
        """The chain length that maximises expected tokens per unit of pass time (`cost(rows)`, the measured pass
        curve) at this request's running acceptance."""
        from ..costs import best_tree_size
        a = self.acceptance()
        return max(1, best_tree_size([a ** (i + 1) for i in range(MAX_DEPTH)], cost))

    def propose(self, context, k, params, generator) -> Draft:
        if self._base is None:
            self._base = len(context)
        self._context = list(context)
        a = np.asarray(context, np.int64)
        tail = a[-MAX_MATCH:]
        n, start = longest_match(a, tail, len(a))  # an earlier occurrence, with a token after it
        source = a
        if n < MAX_MATCH // 4 and self.store.outputs:  # earlier requests' outputs may match longer
            flat = self.store.flat()
            m, s = longest_match(flat, tail, len(flat))
            if m > n:
                n, start, source = m, s, flat
        self._match = n
        if not n:
            self._last = 0
            return Draft()
        limit = min(k, MAX_DEPTH, max(1, int(MATCH_FACTOR * n)))
        follow = source[start: start + limit]
        stop = np.flatnonzero(follow < 0)  # the end of a stored output
        tokens = (follow[: stop[0]] if len(stop) else follow).tolist()
        self._last = len(tokens)
        return Draft(tokens)

    def observe_verify(self, context, draft, logits, accepted) -> None:
        """This request's running acceptance: accepted / proposed over its recent drafts."""
        if not self._last or draft is None or draft.is_tree:
            return
        n = min(len(accepted), self._last)
        self.hits, self.tries = 0.8 * self.hits + n, 0.8 * self.tries + self._last
        self._last = 0
