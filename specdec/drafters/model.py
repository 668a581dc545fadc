"""A draft causal LM sharing the target's tokenizer. Keeps its own KV cache; catches up on tokens it did not
produce (the target's corrections) at the start of the next proposal.

On the runtime a draft model has a prefix cache of its own (runtime/prefix_cache.py, as the target's): a request's
first proposal starts from the cached blocks of its context (a chat template's system prompt, the file an editor
sends again, an earlier turn of the conversation), within the request's tenant, and the blocks it computed are named
when it catches up and when it leaves. Without it the first proposal of every request ran the draft over the whole
prompt: 2.4 ms a token for the pair's 0.5B on the 2-core EPYC, seconds for a long conversation, while the target's
prefill found the same prompt cached. At rest it keeps at most CACHE_BYTES of blocks nobody holds."""
from __future__ import annotations

import os
from time import perf_counter

import torch

from ..kv import cached_model
from ..runtime.blocks import BLOCK
from ..runtime.prefix_cache import PrefixCache
from ..sampling import draw, warp
from .base import Draft

# A draft proposes only among the first HEAD_ROWS token ids, so its step reads only those rows of its head. BPE ids
# follow merge order, roughly frequency: of the pair's target outputs and the shipped prompts, 98.4% and 98.7% of
# tokens are below 65,536 (of 151,936), and the 0.5B draft's head is 37% of the bytes a step reads (docs/draft.md).
# Lossless whatever the cut: verification accepts or corrects any proposal, and a sampled draft's q is 0 beyond it.
HEAD_ROWS = 65536
# A first step that runs more than this many tokens is a catch-up (the prompt, or what other drafters proposed): its
# time is the draft's prefill_ms, which the cost estimates leave out of a drafted token's cost. A step after a
# verification runs 1-2 tokens (the target's own token, and the last accepted draft).
CATCHUP_TOKENS = 8
CACHE_BYTES = 256 * 2**20  # the draft's cached blocks that no request holds, at most (the pair's 0.5B: 21,800
# positions); SPECDEC_DRAFT_PREFIX_CACHE=0 turns its prefix cache off


class ModelDrafter:
    def __init__(self, model, vocab_size: int, name: str = "model", prefixes: PrefixCache | None = None):
        """`prefixes`: the draft model's prefix cache, shared by the forks of one drafter (made here when None)."""
        self.lm = cached_model(model, vocab_size)
        self.name = name
        self.cache_salt = b""  # the tenant of the request it drafts for: its cached blocks are found only by it
        self.prefixes = prefixes if prefixes is not None else _prefix_cache(self.lm)

    def propose(self, context, k, params, generator) -> Draft:
        seq, qs, prefill_ms = list(context), [], 0.0
        self._restore(seq)
        for i in range(k):
            t = perf_counter()
            logits = self.lm.forward(seq, head_rows=HEAD_ROWS)[-1]
            if i == 0 and len(seq) - self.lm.last_start > CATCHUP_TOKENS:
                prefill_ms = (perf_counter() - t) * 1e3
                self._store()
            if params.greedy:
                token = int(logits.argmax())
            else:
                q = warp(logits, params)
                token = draw(q, generator, len(seq))
                qs.append(q)
            seq.append(token)
        return Draft(seq[len(context):], torch.stack(qs) if qs else None, prefill_ms=prefill_ms)

    def _restore(self, seq: list[int]) -> None:
        """A request's first proposal: its slot starts with the cached blocks its context begins with."""
        if self.prefixes is not None and not self.lm.tokens:
            self.lm.rollback(0)  # (an empty slot: a reset drafter may still hold blocks)
            self.lm.tokens = seq[: self.prefixes.restore(seq, self.lm.slot, self.cache_salt)]

    def _store(self) -> None:
        """Name the full blocks of what the slot holds (its K/V are those tokens' alone)."""
        if self.prefixes is not None and self.lm.slot is not None:
            self.prefixes.store(self.lm.tokens, self.lm.slot, self.cache_salt)

    def fork(self) -> ModelDrafter:
        return ModelDrafter(self.lm.model, self.lm.vocab_size, self.name, self.prefixes)

    def close(self) -> None:
        if self.prefixes is not None:  # what this request added (its output too: the next turn's prompt holds it)
            self._store()
        if hasattr(self.lm, "close"):
            self.lm.close()
        if self.prefixes is not None and self.prefixes.max_blocks is not None:
            self.prefixes.model.pool.forget_cached(self.prefixes.max_blocks)

    def reset(self) -> None:
        self.lm.reset()


def _prefix_cache(lm) -> PrefixCache | None:
    """A prefix cache over the draft model's KV pool (the runtime's; none on transformers)."""
    if not hasattr(lm, "slot") or os.environ.get("SPECDEC_DRAFT_PREFIX_CACHE", "1") == "0":
        return None
    model = lm.model
    return PrefixCache(model, max_blocks=CACHE_BYTES // (model.kv_bytes_per_position * BLOCK))
