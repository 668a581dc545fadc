"""Prompt-lookup drafting (Saxena 2023): find an earlier occurrence of the context's last n tokens and propose what
followed it: of the latest LONGEST_OF occurrences, the one whose context goes on matching longest (the latest on a
tie), as suffix decoding chooses. Model-free, so q is one-hot.

min_ngram=2 by default: a single-token match is right too rarely to pay for verifying its block (on the default
model on this CPU a 5-token target pass costs ~1.45 one-token passes; 1-gram proposals lowered the measured speedup
from 1.15x to 1.07x in the cost model over the shipped prompts).

Renames: where the match, looked back, stops at a span the context wrote in place of a span of the source (the
tokens before both agree: `frequency` where the source had `counts`), the copy writes that span for the source's
later occurrences too, as an edit that renames something does."""
from __future__ import annotations

import numpy as np
import torch

from .base import Draft


MAX_MATCH = 64  # the longest match measured (a copy's estimates are bucketed by it)
MAX_RENAMED = 3  # the longest span (tokens, either side) taken for a rename
AGREE = 2  # tokens before a renamed span that must agree with the source's
LONGEST_OF = 32  # the latest occurrences of the n-gram among which the longest match is copied


def matched_before(a: np.ndarray, i: int, j: int) -> int:
    """How many tokens before position i equal those before position j (i < j), at most MAX_MATCH."""
    n = min(i, MAX_MATCH)
    same = a[i - n:i][::-1] == a[j - n:j][::-1]
    return n if same.all() else int(np.argmin(same))


def rename_before(a: np.ndarray, i: int, j: int, back: int) -> tuple[list[int], list[int]] | None:
    """Where the context before j stops matching the source before i, `back` tokens earlier (matched_before): (A, B),
    the source's span and the context's that stand in its place with AGREE equal tokens before both; None if nothing
    such lies there."""
    i, j = i - back, j - back
    if back == MAX_MATCH or i < 1:
        return None
    for la in range(1, MAX_RENAMED + 1):
        for lb in range(1, MAX_RENAMED + 1):
            if min(i - la, j - lb) >= AGREE and (a[i - la - AGREE:i - la] == a[j - lb - AGREE:j - lb]).all():
                return a[i - la:i].tolist(), a[j - lb:j].tolist()
    return None


def renamed(tokens: list[int], old: list[int], new: list[int]) -> list[int]:
    """tokens with each occurrence of `old` written as `new`."""
    out, i, n = [], 0, len(old)
    while i < len(tokens):
        if tokens[i:i + n] == old:
            out += new
            i += n
        else:
            out.append(tokens[i])
            i += 1
    return out


class NgramDrafter:
    name = "ngram"
    free = True  # model-free: proposing costs next to nothing

    def __init__(self, max_ngram: int = 3, min_ngram: int = 2):
        self.max_ngram, self.min_ngram = max_ngram, min_ngram

    def propose(self, context, k, params, generator) -> Draft:
        a = np.asarray(context)  # (numpy: a few µs a call where torch's per-op overhead took ~100 µs)
        L = len(a)
        for n in range(min(self.max_ngram, L - 1), self.min_ngram - 1, -1):
            match = a[:L - n] == a[L - n]  # every earlier n-gram a[i:i+n] that has a follower (i + n < L)...
            for j in range(1, n):
                match &= a[j:L - n + j] == a[L - n + j]  # ...equal to the last n tokens
            hits = np.flatnonzero(match)
            if len(hits):  # the occurrence whose context matches longest, the latest of those (suffix decoding's)
                best = max(hits[-LONGEST_OF:].tolist(), key=lambda h: (matched_before(a, h, L - n), h)) \
                    if LONGEST_OF > 1 else int(hits[-1])
                start, back = int(best) + n, matched_before(a, int(best), L - n)
                tokens = list(context[start:start + k])
                rename = rename_before(a, start - n, L - n, back) if MAX_RENAMED else None
                if rename is not None and len(rename[0]) <= len(tokens):
                    tokens = renamed(list(context[start:start + k + MAX_RENAMED]), *rename)[:k]
                return Draft(tokens, match=min(MAX_MATCH, n + back))
        return Draft()

    def propose_tree(self, context, k, params, generator, branches: int = 3) -> Draft:
        """The continuations of every earlier occurrence of the longest matching n-gram as one tree (the most
        recent first), each node valued by the share of occurrences that agree with its path."""
        ctx = torch.tensor(context)
        for n in range(min(self.max_ngram, len(context) - 1), self.min_ngram - 1, -1):
            hits = (ctx[:-1].unfold(0, n, 1) == ctx[-n:]).all(-1).nonzero().flatten().tolist()
            if not hits:
                continue
            starts = [h + n for h in reversed(hits)]  # most recent first
            tokens, parents, values = [], [], []
            frontier = [(-1, starts, 1.0, 0)]  # (node, occurrences still agreeing, value, depth)
            while frontier:
                node, group, value, depth = frontier.pop(0)
                if depth >= k:
                    continue
                following: dict[int, list[int]] = {}
                for st in group:
                    if st + depth < len(context):
                        following.setdefault(context[st + depth], []).append(st)
                width = branches if node < 0 else 1  # branches at the first token, then each one's majority
                for token, agree in sorted(following.items(), key=lambda kv: -len(kv[1]))[:width]:
                    tokens.append(token), parents.append(node), values.append(value * len(agree) / len(group))
                    frontier.append((len(tokens) - 1, agree, values[-1], depth + 1))
            order = sorted(range(len(tokens)), key=lambda i: -values[i])  # best first (parents before children)
            where = {old: new for new, old in enumerate(order)}
            return Draft([tokens[i] for i in order], parents=[-1 if parents[i] < 0 else where[parents[i]]
                                                             for i in order], values=[values[i] for i in order])
        return Draft()

    def reset(self) -> None:
        pass
