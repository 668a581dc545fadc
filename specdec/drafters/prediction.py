"""`prediction`: a text the client expects most of the answer to be (OpenAI's predicted outputs: the file it asks to
edit), drafted beside the output.

While the output follows the prediction, the drafter proposes the prediction's next tokens. After a rejection (the
output diverged: an insertion, a deletion, a replacement), it finds where the output rejoins the prediction the way
a diff would: the longest suffix of the output that occurs in the prediction, the occurrence nearest after the last
place they agreed. A match of fewer than MIN_REJOIN tokens is trusted only right after that place (a one-token
match anywhere else is too often a coincidence). Model-free: q is one-hot, and it costs microseconds a cycle.

A replacement it rejoined after (the output wrote B where the prediction had A, at most MAX_REPLACED tokens each) is
taken for a rename: the rest of the prediction is drafted with every later A as B. Had the output kept A there, the
rejoin after it learns A back (a wrong guess costs a draft, never the output). A B that holds A is no rename (it
would feed on itself), and renames never make the prediction more than MAX_GROWTH times its length.

Its proposals can be long: `depth(cost)` sizes them on the target's measured pass curve and this request's running
acceptance (costs.best_tree_size on a chain), and the engines ask for that many.

A chat request that sent no prediction but quotes code (a fenced block in its last message: "rewrite this
function") drafts from the quoted block the same way (`quoted_block`), from a lower prior: an answer need not repeat
what it quotes. Nothing about it is reported as OpenAI's prediction usage.
"""
from __future__ import annotations

import re

import numpy as np

from .base import Draft

MIN_REJOIN = 3  # tokens of agreement that re-anchor the walk anywhere in the prediction
MAX_SUFFIX = 32  # the longest output suffix looked up
MAX_DEPTH = 32  # the most tokens one proposal may carry
PRIOR = 0.9  # acceptance assumed before any verification: a prediction is usually right
QUOTED_PRIOR = 0.6  # the same for a block the prompt quotes (quoted_block): drafts short until the answer follows it
MIN_QUOTED_CHARS = 64  # a shorter quoted block is not worth drafting from
FENCED = re.compile(r"```[^\n`]*\n.*?```", re.S)
MAX_REPLACED = 6  # the longest replacement (tokens either side) taken for a rename
MAX_GROWTH = 2  # renames never make what is drafted from longer than this many times the prediction


class PredictionDrafter:
    name = "prediction"
    free = True
    sizes_own_depth = True  # the engines ask it for depth(cost) tokens, not τ

    def __init__(self, prediction: list[int], start: int | None = None, prior: float = PRIOR):
        """`start`: the prompt's length, where the output starts (the batch engine's first proposal comes after the
        prefill has emitted a token); None: at the context of the first proposal. `prior`: the acceptance assumed
        before any verification."""
        self.original = np.asarray(prediction, dtype=np.int64)
        self.start, self.prior = start, prior
        self.reset()

    def reset(self) -> None:
        self.pred = self.original  # what is drafted from: the prediction, with the renames learned so far
        self.left: tuple[int, int] | None = None  # (prediction, output) index where the output last left it
        self.base = self.start  # the output starts there (None: at the first proposal's context)
        self.at = 0  # prediction index of the next expected token
        self.aligned = True  # the output is at `at` (it starts at the prediction's start)
        self.seen = 0  # output tokens accounted for by `at`
        self.hits, self.tries = self.prior * 4, 4.0  # accepted / proposed, a prior worth four drafts
        self.accepted = self.rejected = 0  # prediction tokens accepted / proposed and rejected (usage)
        self._last = 0

    def fork(self) -> PredictionDrafter:
        return PredictionDrafter(self.original.tolist(), self.start, self.prior)

    # ---- where the output stands in the prediction ----------------------------------------------------------
    def _align(self, out: list[int]) -> int | None:
        new = out[self.seen:]
        self.seen = len(out)
        if self.aligned:  # how much of the output since the last call followed the prediction, drafted or not (a
            # request the scheduler gave no rows still learns that it is in step)
            m = min(len(new), len(self.pred) - self.at)
            same = self.pred[self.at:self.at + m] == np.asarray(new[:m], dtype=np.int64)
            agree = m if same.all() else int(np.argmin(same))
            self.hits, self.tries = 0.8 * self.hits + agree, 0.8 * self.tries + len(new)
            if agree == len(new):
                self.at += agree  # still in step
                return self.at
            self.left = (self.at + agree, len(out) - len(new) + agree)
        found = self._rejoin(out)
        self.aligned = found is not None
        if found is None:
            return None
        self.at, matched = found
        self._learn_rename(out, matched)
        if matched >= MIN_REJOIN:  # back in step for sure: drafts long again at once, not after a slow recovery
            self.hits = max(self.hits, PRIOR * self.tries)
        return self.at

    def _learn_rename(self, out: list[int], matched: int) -> None:
        """After a rejoin: what the output wrote between leaving the prediction and the matched suffix (B), where the
        prediction had A, becomes B in the rest of the prediction when A occurs there again."""
        if self.left is None:
            return
        (lp, lo), self.left = self.left, None
        a = self.pred[lp: self.at - matched]
        b = np.asarray(out[lo: len(out) - matched], dtype=np.int64)
        if not (0 < len(a) <= MAX_REPLACED and 0 < len(b) <= MAX_REPLACED) or self.at - matched < lp:
            return
        if len(_occurrences(b, a)):  # B holds A: each later rename of it would grow the prediction again
            return
        rest = self.pred[self.at:]
        hits = _occurrences(rest, a)
        if len(hits) and len(self.pred) + len(hits) * (len(b) - len(a)) <= MAX_GROWTH * len(self.original):
            self.pred = np.concatenate([self.pred[: self.at], _replace(rest, hits, len(a), b)])

    def _rejoin(self, out: list[int]) -> tuple[int, int] | None:
        """(The prediction index after the longest suffix of `out` found in it, nearest after `at` among the
        occurrences of that length; that suffix's length), or None."""
        tail = np.asarray(out[-MAX_SUFFIX:], dtype=np.int64)
        best = None
        for n in range(1, len(tail) + 1):
            suffix = tail[-n:]
            hits = _occurrences(self.pred, suffix)
            if not len(hits):
                break
            ends = hits + n
            after = ends[ends >= self.at]
            best = (n, int(after[0]) if len(after) else int(ends[0]), len(after) > 0 and int(after[0]) == self.at)
        if best is None:
            return None
        n, end, adjacent = best
        if n < MIN_REJOIN and not adjacent and not _near(end, self.at, n):
            return None
        return end, n

    # ---- the drafter ---------------------------------------------------------------------------------------
    def acceptance(self) -> float:
        """This request's running acceptance of predicted tokens (its prior before any verification)."""
        return min(0.99, self.hits / self.tries)

    def depth(self, cost) -> int:
        """How many tokens to propose: the chain length that maximises expected tokens per unit of pass time,
        `cost(rows)` the measured pass curve, acceptance this request's running rate."""
        from ..costs import best_tree_size
        a = self.acceptance()
        return max(1, best_tree_size([a ** (i + 1) for i in range(MAX_DEPTH)], cost))

    def propose(self, context, k, params, generator) -> Draft:
        if self.base is None:
            self.base = len(context)
        at = self._align(list(context[self.base:]))
        if at is None or at >= len(self.pred):
            self._last = 0
            return Draft()
        tokens = self.pred[at: at + min(k, MAX_DEPTH)].tolist()
        self._last = len(tokens)
        return Draft(tokens)

    def observe_verify(self, context, draft, logits, accepted) -> None:
        """Count what was verified of its last proposal (usage's accepted / rejected)."""
        if not self._last or draft is None or draft.is_tree:
            return
        n = min(len(accepted), self._last)
        self.accepted += n
        self.rejected += min(self._last, len(draft.tokens)) - n
        self._last = 0


def _occurrences(a: np.ndarray, s: np.ndarray) -> np.ndarray:
    """Start indices of s in a."""
    n = len(s)
    if n > len(a):
        return np.empty(0, dtype=np.int64)
    match = a[: len(a) - n + 1] == s[0]
    for j in range(1, n):
        match &= a[j: len(a) - n + 1 + j] == s[j]
    return np.flatnonzero(match)


def _replace(a: np.ndarray, starts: np.ndarray, n: int, b: np.ndarray) -> np.ndarray:
    """a with each non-overlapping n-token span at `starts` (ascending) replaced by b."""
    parts, at = [], 0
    for i in starts.tolist():
        if i >= at:
            parts += [a[at:i], b]
            at = i + n
    return np.concatenate(parts + [a[at:]])


def _near(end: int, at: int, n: int, slack: int = 8) -> bool:
    """A short match within a few tokens after the last agreement (a small insertion or deletion)."""
    return at <= end <= at + n + slack


def quoted_block(prompt) -> str | None:
    """The longest fenced code block (fences included) of a chat prompt's last message, if at least
    MIN_QUOTED_CHARS long: what an answer that rewrites quoted code mostly repeats. `prompt`: a string or a list of
    {role, content} messages."""
    last = prompt[-1] if isinstance(prompt, list) and prompt else None
    text = prompt if isinstance(prompt, str) else last.get("content") if isinstance(last, dict) else None
    if not isinstance(text, str):
        return None
    block = max(FENCED.findall(text), key=len, default="")
    return block if len(block) >= MIN_QUOTED_CHARS else None
