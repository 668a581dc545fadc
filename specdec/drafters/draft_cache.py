"""A draft model's caches, shared by the forks of one ModelDrafter (drafters/model.py).

- **Its prefix cache** (runtime/prefix_cache.py, the target's class over the draft's own KV pool): a request's first
  proposal starts from the cached blocks its context begins with (a chat template's system prompt, the file an
  editor sends again, an earlier turn of the conversation), within the request's tenant; the blocks are named when
  the draft catches up and when the request leaves (its answer too). At rest it keeps at most CACHE_BYTES of blocks
  no request holds. Without it the first proposal of every request ran the draft over the whole context: 2.4 ms a
  token for the pair's 0.5B on the 2-core EPYC, seconds for a long conversation, while the target's prefill found
  the same prompt cached.
- **Catch-ups that cannot pay are put off.** A request whose first proposal would run the draft over more context
  than its tokens left can repay (the catch-up's measured ms a token times its length, against the ms each token
  left is expected to save: what the scheduler prices drafting to save at the batch's load, scheduler.saved_ms)
  drafts nothing with the model; one shorter than MEASURED tokens is priced by the split instead, charged what the
  request's drafting is not expected to repay (DraftCache.unrepaid_ms), so a request is never locked out by one
  moment's prices, and a cheap catch-up is not priced as if one cycle had to repay it. A catch-up stalls every
  request in the batch: at 8 streams on the pair the 0.5B's catch-ups were most of its drafting time, and it served
  0.86x target-only's tokens/s. Each cycle while it is put off, the catch-up is weighed again for the tokens the
  request has left at the load then (ModelDrafter.reconsider): once the load falls and it pays (a request left alone
  at the end of a burst), it runs and the request drafts. The request's chain's model-free members still propose.
  When it leaves still put off, its context waits for idle time: the server's worker, with nothing to run, catches
  the draft up on it IDLE_CHUNK tokens at a time (a request that arrives waits at most one chunk) and names the
  blocks, so the conversation's next turn finds them. A server measures the rate at start (once per draft file and machine);
  catch-ups of at least MEASURED tokens refine it. Without a rate nothing is put off.

Nothing here reaches an output: verification accepts or corrects whatever the draft proposes, and a position's K/V
depend only on the tokens up to it.
"""
from __future__ import annotations

import os
from collections import deque
from collections.abc import Callable
from time import perf_counter

from ..runtime.blocks import BLOCK
from ..runtime.prefix_cache import PrefixCache

CACHE_BYTES = 256 * 2**20  # cached blocks no request holds, at most (the pair's 0.5B: 21,800 positions)
MEASURED = 64  # the shortest catch-up whose time sets the rate (shorter ones are mostly a step's fixed cost)
IDLE_CHUNK = 64  # tokens an idle-time catch-up runs a call
PENDING = 8  # put-off catch-ups waiting for idle time, the newest kept


def draft_cache(lm) -> DraftCache | None:
    """A draft's caches over its KV pool (the runtime's; none on transformers, or with SPECDEC_DRAFT_PREFIX_CACHE=0)."""
    if not hasattr(lm, "slot") or os.environ.get("SPECDEC_DRAFT_PREFIX_CACHE", "1") == "0":
        return None
    return DraftCache(lm.model, lm.vocab_size)


class DraftCache:
    def __init__(self, model, vocab_size: int):
        self.model, self.vocab_size = model, vocab_size
        self.prefixes = PrefixCache(model, max_blocks=CACHE_BYTES // (model.kv_bytes_per_position * BLOCK))
        self.ms_per_token: float | None = None  # a catch-up's measured cost
        self.pending: deque[tuple[list[int], bytes]] = deque(maxlen=PENDING)  # (context, tenant) put off
        self.idle = None  # (slot cache, context, tenant) of the idle-time catch-up under way
        self.put_off = 0  # requests whose catch-up was put off (a count for tests and diagnosis)

    # ---- a request's slot ----------------------------------------------------------------------------------
    def restore(self, lm, seq: list[int], salt: bytes) -> None:
        """A request's first proposal: its empty slot starts with the cached blocks its context begins with."""
        lm.rollback(0)  # (a reset drafter may still hold blocks)
        lm.tokens = seq[: self.prefixes.restore(seq, lm.slot, salt)]

    def store(self, lm, salt: bytes) -> None:
        """Name the full blocks of what the slot holds (their K/V are those tokens' alone)."""
        if lm.slot is not None:
            self.prefixes.store(lm.tokens, lm.slot, salt)

    def release(self, lm, salt: bytes) -> None:
        """A request leaves: its blocks named, its slot given back, the cache back within its bound."""
        self.store(lm, salt)
        lm.close()
        self.model.pool.forget_cached(self.prefixes.max_blocks)

    # ---- what a catch-up costs, and putting it off -------------------------------------------------------
    def observe(self, tokens: int, ms: float) -> None:
        if tokens >= MEASURED:
            rate = ms / tokens
            self.ms_per_token = rate if self.ms_per_token is None else 0.7 * self.ms_per_token + 0.3 * rate

    def measure(self) -> float:
        """ms a token of a catch-up over 2·MEASURED tokens, on a scratch slot (given back after): what a server
        starts with (runtime/measured.py keeps it per draft file and machine)."""
        lm = self.model.new_cache(self.vocab_size)
        try:
            ids = [1 + (7919 * i) % (self.vocab_size - 1) for i in range(3 * MEASURED)]
            lm.forward(ids[:MEASURED], head_rows=1)  # (warm)
            t = perf_counter()
            lm.forward(ids, head_rows=1)
            return (perf_counter() - t) * 1e3 / (len(ids) - MEASURED)
        finally:
            lm.close()

    def pays(self, behind: int, budget: tuple[int, Callable[[], float]] | None) -> bool:
        """Whether running the draft over `behind` unseen tokens pays for a request with `budget` = (tokens it may
        still emit, the ms a token drafting saves at the batch's load now); unknown: yes. The catch-up stalls the
        whole batch, and under load each token's share of a pass, and of its saving, is small."""
        if budget is None or self.ms_per_token is None:
            return True
        if behind < MEASURED:  # short: the split prices it (unrepaid_ms). Put off for good, a request never drafts:
            return True  # on short chats at one stream every request was, and no acceptance was ever measured again
        left, saves = budget
        return self.ms_per_token * behind <= left * saves()

    def unrepaid_ms(self, behind: int, budget: tuple[int, Callable[[], float]] | None) -> float:
        """ms of a first catch-up over `behind` tokens that the request's drafting is not expected to repay: its cost
        less (tokens it may still emit) x (ms a token drafting saves at the batch's load now), at least 0; the whole
        cost without a budget. What the split charges the cycle that would run it (ModelDrafter.catch_up_ms)."""
        cost = self.ms_per_token * behind if self.ms_per_token is not None and behind > 0 else 0.0
        if budget is None or not cost:
            return cost
        left, saves = budget
        return max(0.0, cost - left * saves())

    def put_off_for_idle(self, context: list[int], salt: bytes) -> None:
        self.pending.append((list(context), salt))

    def idle_work(self) -> int:
        """Put-off catch-ups queued or under way."""
        return len(self.pending) + (self.idle is not None)

    def idle_step(self) -> bool:
        """One chunk of the oldest put-off catch-up -> whether any work remains."""
        if self.idle is None:
            if not self.pending:
                return False
            context, salt = self.pending.popleft()
            lm = self.model.new_cache(self.vocab_size)
            self.restore(lm, context, salt)
            self.idle = (lm, context, salt)
        lm, context, salt = self.idle
        end = min(len(lm.tokens) + IDLE_CHUNK, len(context))
        if end > len(lm.tokens):
            t = perf_counter()
            ran = end - len(lm.tokens)
            lm.forward(context[:end], head_rows=1)  # its K/V are what counts: one logit
            self.observe(ran, (perf_counter() - t) * 1e3)
        if end == len(context):
            self.release(lm, salt)
            self.idle = None
        return self.idle_work() > 0
