"""A draft causal LM sharing the target's tokenizer. Keeps its own KV cache; catches up on tokens it did not
produce (the target's corrections) at the start of the next proposal. On the runtime its forks share a prefix cache
and put off catch-ups that cannot pay (drafters/draft_cache.py)."""
from __future__ import annotations

from time import perf_counter

import torch

from ..kv import cached_model
from ..runtime.blocks import BLOCK
from ..runtime.slot_cache import SlotCache, common_prefix_len, forward_slots
from ..sampling import draw, warp
from .base import Draft
from .draft_cache import MEASURED, DraftCache, draft_cache

# A draft proposes only among the first HEAD_ROWS token ids, so its step reads only those rows of its head. BPE ids
# follow merge order, roughly frequency: of the pair's target outputs and the shipped prompts, 98.4% and 98.7% of
# tokens are below 65,536 (of 151,936), and the 0.5B draft's head is 37% of the bytes a step reads (CHANGELOG.md,
# "A draft model reads a third of its head").
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
        self.put_off = False  # this request's catch-up did not pay: it drafts nothing with the model (for now)
        self._put_off_at: int | None = None  # its context's length then (the tokens it may still emit: reconsider)
        self._cached: int | None = None  # positions of its first context the draft's prefix cache held (catch_up_ms)
        self._context = None  # the request's context as last proposed for (what a put-off catch-up runs later)

    def propose(self, context, k, params, generator) -> Draft:
        return ModelDrafter.propose_many([self], [context], [k], [params], [generator])[0]

    @staticmethod
    @torch.inference_mode()
    def propose_many(drafters, contexts, ks, params, generators) -> list[Draft]:
        """Chains for several sequences, each with its own fork. On the runtime each step is one pass of the draft
        for all of them (runtime/slot_cache.forward_slots: each row as alone, so each chain is its fork's own);
        a catch-up's share of the first step is that request's prefill_ms."""
        live = [i for i, k in enumerate(ks) if k and drafters[i]._starts(contexts[i])]
        seqs, qs, prefill = {i: list(contexts[i]) for i in live}, {i: [] for i in live}, dict.fromkeys(live, 0.0)
        batched = len({id(getattr(drafters[i].lm, "model", None)) for i in live}) == 1 and all(
            isinstance(drafters[i].lm, SlotCache) for i in live)
        adjust = {i: params[i].penalties.after(seqs[i]) for i in live if params[i].penalties is not None}
        for step in range(max((ks[i] for i in live), default=0)):
            group = [i for i in live if ks[i] > step]
            t = perf_counter()
            if batched:
                logits = forward_slots([drafters[i].lm for i in group], [seqs[i] for i in group], HEAD_ROWS)
            else:
                logits = [drafters[i].lm.forward(seqs[i], head_rows=HEAD_ROWS)[-1] for i in group]
            if step == 0:  # the catch-ups: each its share of the pass's rows
                ran = {i: len(seqs[i]) - drafters[i].lm.last_start for i in group}
                ms = (perf_counter() - t) * 1e3 / sum(ran.values())
                for i in group:
                    prefill[i] = drafters[i]._caught_up(ran[i], ms * ran[i])
            for row, i in enumerate(group):
                scores = adjust[i].masked(logits[row]) if i in adjust else logits[row]  # as the target's rows are
                if params[i].greedy:
                    token = int(scores.argmax())
                else:
                    q = warp(scores, params[i])
                    token = draw(q, generators[i], len(seqs[i]))
                    qs[i].append(q)
                if i in adjust:
                    adjust[i].accept(token)
                seqs[i].append(token)
        out = [Draft() for _ in drafters]
        for i in live:
            out[i] = Draft(seqs[i][len(contexts[i]):], torch.stack(qs[i]) if qs[i] else None, prefill_ms=prefill[i])
        return out

    def _starts(self, context) -> bool:
        """Before a proposal: whether the model drafts for this request (not once its catch-up was put off); a first
        proposal starts from the cached blocks its context begins with."""
        self._context = context
        self.reconsider(context)
        if self.put_off:
            return False
        cache = self.draft_cache
        if cache is not None and not self.lm.tokens:
            cache.restore(self.lm, list(context), self.cache_salt)
            if not cache.pays(len(context) - len(self.lm.tokens), self.budget):
                self.put_off, self._put_off_at = True, len(context)
                cache.put_off += 1
                return False
        return True

    def reconsider(self, context) -> None:
        """A put-off catch-up weighed again at the batch's load now, for the tokens the request may still emit: where
        it pays now (the load fell), this proposal catches up and drafts. Put off for good, a request that arrived
        under load drafted nothing for its life, alone at the end of a burst too, where a drafted token saves most
        (the pair at 8 streams: the 0.5B's last requests of each window ran alone undrafted, and its windows took as
        long as target-only's)."""
        cache = self.draft_cache
        if not self.put_off or cache is None or self.budget is None or self._put_off_at is None:
            return
        left = self.budget[0] - (len(context) - self._put_off_at)
        if left > 0 and cache.pays(len(context) - len(self.lm.tokens), (left, self.budget[1])):
            self.put_off = False

    def catch_up_ms(self, context) -> float:
        """What its next proposal for `context` would first spend on tokens it did not draft (a chain's copy, the
        target's corrections) beyond a step's usual CATCHUP_TOKENS, at the catch-up rate measured, charged to the
        one cycle that runs it (they recur: each copied stretch leaves the draft behind again); 0 once put off. Its
        first proposal's, on a prompt shorter than MEASURED, runs once and is repaid over the request's life: only
        what that leaves unrepaid is charged (DraftCache.unrepaid_ms; a longer one is weighed by DraftCache.pays).
        Charged whole to one cycle, a 50-token prompt at 2 ms a token paid in no cycle at one stream: the pair's
        0.5B sat out the first 9-36 passes of each completion until a probe or a moment's prices let it in."""
        cache = self.draft_cache
        if self.put_off or cache is None or cache.ms_per_token is None:
            return 0.0
        if not self.lm.tokens:  # its first: the prompt past the cached blocks (looked up once)
            if self._cached is None:
                self._cached = len(cache.prefixes.lookup(list(context), self.cache_salt)) * BLOCK
            behind = len(context) - self._cached
            if behind >= MEASURED:  # long: weighed at the first proposal (DraftCache.pays: run, or put off for idle)
                return 0.0
            return cache.unrepaid_ms(behind, self.budget) if behind > CATCHUP_TOKENS else 0.0
        behind = len(context) - common_prefix_len(self.lm.tokens, context)
        return behind * cache.ms_per_token if behind > CATCHUP_TOKENS else 0.0

    def _caught_up(self, ran: int, ms: float) -> float:
        """After a proposal's first step ran `ran` tokens in `ms`: a catch-up's time (its prefill_ms), else 0; a
        catch-up's blocks are named and its rate observed."""
        if ran <= CATCHUP_TOKENS:
            return 0.0
        if self.draft_cache is not None:
            self.draft_cache.observe(ran, ms)
            self.draft_cache.store(self.lm, self.cache_salt)
        return ms

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
        self.put_off, self._put_off_at, self._context, self._cached = False, None, None, None
