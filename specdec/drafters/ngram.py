"""Prompt-lookup drafting (Saxena 2023): find the latest earlier occurrence of the context's last n tokens and
propose what followed it. Model-free, so q is one-hot."""
from __future__ import annotations

import torch

from .base import Draft


class NgramDrafter:
    name = "ngram"

    def __init__(self, max_ngram: int = 3, min_ngram: int = 1):
        self.max_ngram, self.min_ngram = max_ngram, min_ngram

    def propose(self, context, k, params, generator) -> Draft:
        ctx = torch.tensor(context)
        for n in range(min(self.max_ngram, len(context) - 1), self.min_ngram - 1, -1):
            windows = ctx[:-1].unfold(0, n, 1)  # every earlier n-gram that has at least one follower
            hits = (windows == ctx[-n:]).all(-1).nonzero()
            if len(hits):
                start = int(hits[-1]) + n
                return Draft(context[start:start + k])
        return Draft()

    def reset(self) -> None:
        pass
