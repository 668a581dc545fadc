"""A draft causal LM sharing the target's tokenizer. Keeps its own KV cache; catches up on tokens it did not
produce (the target's corrections) at the start of the next proposal. On the runtime its forks share a prefix cache
and put off catch-ups that cannot pay (drafters/draft_cache.py)."""
from __future__ import annotations

from time import perf_counter

import torch

from ..kv import cached_model
from ..sampling import draw, warp
from .base import Draft
from .draft_cache import DraftCache, draft_cache

# A draft proposes only among the first HEAD_ROWS token ids, so its step reads only those rows of its head. BPE ids
# follow merge order, roughly frequency: of the pair's target outputs and the shipped prompts, 98.4% and 98.7% of
# tokens are below 65,536 (of 151,936), and the 0.5B draft's head is 37% of the bytes a step reads (docs/draft.md).
# Lossless whatever the cut: verification accepts or corrects any proposal, and a sampled draft's q is 0 beyond it.
HEAD_ROWS = 65536
# A first step that runs more than this many tokens is a catch-up (the prompt, or what other drafters proposed): its
# time is the draft's prefill_ms, which the cost estimates leave out of a drafted token's cost. A step after a
# verification runs 1-2 tokens (the target's own token, and the last accepted draft).
CATCHUP_TOKENS = 8


class ModelDrafter:
    def __init__(self, model, vocab_size: int, name: str = "model", cache: DraftCache | None = None):
        """`cache`: the draft's caches, shared by the forks of one drafter (made here when None)."""
        self.lm = cached_model(model, vocab_size)
        self.name = name
        self.draft_cache = cache if cache is not None else draft_cache(self.lm)
        self.cache_salt = b""  # the tenant of the request it drafts for: its cached blocks are found only by it
        self.budget: tuple[int, float] | None = None  # (tokens the request may emit, ms of a target pass)
        self.put_off = False  # this request's catch-up did not pay: it drafts nothing with the model
        self._context = None  # the request's context as last proposed for (what a put-off catch-up runs later)

    def propose(self, context, k, params, generator) -> Draft:
        self._context = context
        if self.put_off:
            return Draft()
        seq, qs, prefill_ms = list(context), [], 0.0
        cache = self.draft_cache
        if cache is not None and not self.lm.tokens:  # the request's first proposal
            cache.restore(self.lm, seq, self.cache_salt)
            if not cache.pays(len(seq) - len(self.lm.tokens), self.budget):
                self.put_off = True
                cache.put_off += 1
                return Draft()
        for i in range(k):
            t = perf_counter()
            logits = self.lm.forward(seq, head_rows=HEAD_ROWS)[-1]
            if i == 0 and len(seq) - self.lm.last_start > CATCHUP_TOKENS:
                prefill_ms = (perf_counter() - t) * 1e3
                if cache is not None:
                    cache.observe(len(seq) - self.lm.last_start, prefill_ms)
                    cache.store(self.lm, self.cache_salt)
            if params.greedy:
                token = int(logits.argmax())
            else:
                q = warp(logits, params)
                token = draw(q, generator, len(seq))
                qs.append(q)
            seq.append(token)
        return Draft(seq[len(context):], torch.stack(qs) if qs else None, prefill_ms=prefill_ms)

    def fork(self) -> ModelDrafter:
        return ModelDrafter(self.lm.model, self.lm.vocab_size, self.name, self.draft_cache)

    def close(self) -> None:
        """The request left: its blocks named (its output too: the next turn's prompt holds it), a put-off catch-up
        queued for idle time."""
        cache = self.draft_cache
        if cache is None:
            if hasattr(self.lm, "close"):
                self.lm.close()
            return
        if self.put_off and self._context is not None:
            cache.put_off_for_idle(self._context, self.cache_salt)
        cache.release(self.lm, self.cache_salt)

    def reset(self) -> None:
        self.lm.reset()
        self.put_off, self._context = False, None
