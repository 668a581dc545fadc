"""A draft causal LM sharing the target's tokenizer. Keeps its own KV cache; catches up on tokens it did not
produce (the target's corrections) at the start of the next proposal."""
from __future__ import annotations

from time import perf_counter

import torch

from ..kv import cached_model
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


class ModelDrafter:
    def __init__(self, model, vocab_size: int, name: str = "model"):
        self.lm = cached_model(model, vocab_size)
        self.name = name

    def propose(self, context, k, params, generator) -> Draft:
        seq, qs, prefill_ms = list(context), [], 0.0
        for i in range(k):
            t = perf_counter()
            logits = self.lm.forward(seq, head_rows=HEAD_ROWS)[-1]
            if i == 0 and len(seq) - self.lm.last_start > CATCHUP_TOKENS:
                prefill_ms = (perf_counter() - t) * 1e3
            if params.greedy:
                token = int(logits.argmax())
            else:
                q = warp(logits, params)
                token = draw(q, generator, len(seq))
                qs.append(q)
            seq.append(token)
        return Draft(seq[len(context):], torch.stack(qs) if qs else None, prefill_ms=prefill_ms)

    def fork(self) -> ModelDrafter:
        return ModelDrafter(self.lm.model, self.lm.vocab_size, self.name)

    def close(self) -> None:
        if hasattr(self.lm, "close"):
            self.lm.close()

    def reset(self) -> None:
        self.lm.reset()
