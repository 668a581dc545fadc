"""Continuous batching: every running request shares each target pass (the runtime's KV slots, runtime/model.py).

One `step()` is one cycle for every request in it:
1. rows the pass carries anyway: each decoding request's newest token, then prompt chunks of joining requests
   (at most `prefill_chunk` rows each, so a long prompt never stalls the others);
2. the verification budget (scheduler.py) splits the rows left under `max_batch_rows` into draft rows τ_i;
3. each request's own drafter proposes up to τ_i tokens, all requests' drafts in one batched call (the feature
   draft runs its layer once per step for all of them). A model-free drafter (n-gram, datastore) proposes before
   step 2 instead, as far as the request may draft: its proposal costs next to nothing, so the scheduler sees what
   there is to verify and acceptance is estimated over the cycles that had a proposal;
4. ONE target pass over all rows, each at its own position in its own slot;
5. each request verifies its block with its own rule and randomness, emits, and rolls its slot back.

A drafter that proposes token trees (recycle) gets them verified here too: a tree's nodes, best first, are rows
like a chain's, and the scheduler sees them as draft positions whose chance of acceptance is each node's value
(drafters/tree.py), so a tree is cut to what the budget pays for. The accepted path is compacted in the slot.

Prefix caching (as vLLM's and SGLang's): the K/V of recent prompts are kept in slots of their own, and a joining
request copies the longest cached prefix of its prompt (a chat template's system prompt, an earlier turn) instead of
computing it: bitwise the same keys and values, fewer prefill rows.

The runtime computes every row on its own, so a request's logits, and hence its greedy tokens, are bitwise those it
gets alone; seeded sampling draws from per-position noise (sampling.PositionNoise), so its tokens do not depend
on τ or on the other requests either. Requests join and leave at cycle boundaries.
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from statistics import median
from time import perf_counter

import torch

from .drafters.base import Draft, close, fork, propose_many
from .drafters.tree import best_chain, depths, path, prune
from .engine import StopCheck, cut
from .kernels import argmax as row_argmax
from .policy import AdaptivePolicy, _Ema
from .errors import InvalidRequest
from .runtime.blocks import BLOCK, OutOfBlocks, prefix_hashes
from .runtime.model import Llama, fit_vocab
from .sampling import PositionNoise, SamplingParams, token_logprobs
from .scheduler import Demand, plan
from .drafters.prediction import PredictionDrafter
from .trace import CycleRecord, shortfall
from .verification import choice_rows, committed_rows, verify_block, verify_constrained, verify_tree


@dataclass
class Sequence:
    """One request in the batch: its tokens, its slot, its drafter, its randomness and acceptance estimates."""
    prompt: list[int]
    max_new_tokens: int
    params: SamplingParams
    stop: StopCheck | None = None
    max_tau: int = 8  # the most draft rows it may get per cycle
    fixed_tau: bool = False  # a fixed-τ request drafts exactly max_tau whenever the budget allows
    constraint: object = None  # constraints.Constraint: a grammar the output follows (structured outputs)
    logprobs: int | None = None  # report the emitted tokens' logprobs and this many alternatives
    prompt_logprobs: int | None = None  # report the prompt's too (every prefill row's logits; max_new_tokens may be 0)
    prediction: list[int] | None = None  # a predicted output's tokens: drafted first (drafters/prediction.py)
    cache_salt: bytes = b""  # its tenant: prompts are cached, found and shared only within one tenant
    id: int = field(default_factory=itertools.count().__next__)
    finish_reason: str | None = None

    def __post_init__(self):
        self.tokens = list(self.prompt)
        self.fed = 0  # positions of `tokens` already in the KV slot
        self.cycle = 0
        self.idle = 0  # cycles in a row it could have drafted and got no rows
        self.generator = self.params.generator()
        self.scored: list = []  # prompt logprobs so far
        self.predicted = PredictionDrafter(self.prediction) if self.prediction and self.constraint is None else None
        self.after: int | None = None  # waits for this request's prefill of the same prompt, then copies its K/V
        self.preempted = False  # its blocks were taken back: it waits for memory, then recomputes its tokens

    @property
    def generated(self) -> list[int]:
        return self.tokens[len(self.prompt):]

    @property
    def prefilling(self) -> bool:
        return len(self.tokens) - self.fed > 1 and not self.preempted


class PrefixCache:
    """Prompts' K/V shared by block (runtime/blocks.py, as vLLM's prefix caching): once a prompt is in its slot, its
    full blocks are named by their prefix hashes; a joining request whose prompt starts with named blocks holds them
    instead of computing them (bitwise the same keys and values). Blocks nobody holds stay named until the pool needs
    them, least recently used first: the cache lives within the KV budget."""

    def __init__(self, model: Llama):
        self.model = model
        self.hits = self.reused = 0  # requests served from the cache, positions shared instead of computed
        self.queried = 0  # positions looked up (all of a prompt but its last token)

    def lookup(self, tokens: list[int], salt: bytes = b"") -> list[int]:
        """The cached blocks `tokens` starts with, for this tenant (`salt`: a tenant's prompts hash apart from every
        other's, so nothing of one can be found, shared or timed by another): the one walk of a prompt's hashes
        that admission, the 429 prediction and restore all use."""
        pool, found = self.model.pool, []
        for digest in prefix_hashes(tokens, len(tokens) // BLOCK, salt):
            block = pool.by_hash.get(digest)
            if block is None:
                break
            found.append(block)
        return found

    def restore(self, tokens: list[int], slot: int, salt: bytes = b"") -> int:
        """Share the longest cached prefix of `tokens` into the empty `slot` -> the positions it covers (all but the
        last token at most: that row's logits are needed; writing it copies its block first)."""
        self.queried += max(0, len(tokens) - 1)
        found = self.lookup(tokens, salt)
        if not found:
            return 0
        self.model.share(slot, found)
        n = min(len(found) * BLOCK, len(tokens) - 1)
        self.hits, self.reused = self.hits + 1, self.reused + n
        return n

    def store(self, tokens: list[int], slot: int, salt: bytes = b"") -> None:
        """Name the full blocks of a prompt just computed in `slot`, for this tenant."""
        pool = self.model.pool
        for digest, block in zip(prefix_hashes(tokens, len(tokens) // BLOCK, salt), self.model.blocks_of(slot)):
            pool.register(block, digest)


PROBE_EVERY = 8  # a request denied draft rows this many cycles in a row gets one, to re-measure its acceptance


class BatchEngine:
    def __init__(self, model: Llama, drafter, vocab_size: int, eos_ids: set[int], context_window: int,
                 max_batch_rows: int = 64, prefill_chunk: int = 32, pass_curve: dict[int, float] | None = None,
                 prefix_cache: bool = True):
        """`drafter` is the template each request's drafter is forked from (drafters.base.fork); `pass_curve`
        the measured ms of a pass by rows (measure_pass_curve), refined online; `prefix_cache` whether prompts'
        K/V blocks are kept for reuse (never for a drafter that reads the target's hidden states, which a shared
        prefix does not give it). Memory is the model's KV pool (Llama.set_kv_memory)."""
        if max_batch_rows < 1 or prefill_chunk < 1:
            raise ValueError("max_batch_rows and prefill_chunk must be >= 1")
        self.model, self.drafter, self.vocab_size = model, drafter, vocab_size
        self.eos_ids, self.context_window = set(eos_ids), context_window
        self.max_batch_rows, self.prefill_chunk = max_batch_rows, prefill_chunk
        self.wants_hidden = getattr(drafter, "wants_target_hidden", False)
        self.prefixes = PrefixCache(model) if prefix_cache and not self.wants_hidden else None
        self.preemptions = 0
        # the work of a row at position p: row_ms + key_ms·p (attention grows with the keys it reads), scaled by what
        # passes measure (calibrate(), measure_row_cost); what admission predicts finishing times with
        curve = pass_curve or {1: 10.0}
        self.row_ms, self.key_ms = curve[max(curve)] / max(curve), 0.0
        self._work_scale = _Ema(1.0, weight=8.0, decay=0.95)  # measured / predicted pass time; calibration = 8 passes
        self._recent_pass = _Ema(min(curve.values()), decay=0.8)  # ms of the passes lately, whatever their rows
        self.running: list[Sequence] = []
        self._state: dict[int, tuple] = {}  # id -> (slot, drafter, acceptance estimates)
        self._pass = {n: _Ema(ms, weight=2.0, decay=0.9) for n, ms in (pass_curve or {1: 10.0}).items()}
        self.shared = AdaptivePolicy(1, 16)  # acceptance by position over all requests: a new request's prior
        self.last = {}  # the last step's figures (rows, taus, verify_ms), for metrics; {} when it ran no pass
        self.failed: list[tuple[Sequence, BaseException]] = []  # the last step's requests that failed on their own

    # ---- membership -------------------------------------------------------------------------------------------
    @property
    def free_rows(self) -> int:
        return self.max_batch_rows - len(self.running)

    @property
    def prefill_full(self) -> bool:
        """Whether as many prompts are being computed as a pass has chunks for (prompts are computed in order of
        arrival; one admitted beyond these would only hold memory and wait)."""
        busy = sum(1 for s in self.running if (s.prefilling and s.after is None) or s.preempted)
        return busy >= max(1, self.max_batch_rows // self.prefill_chunk)

    def kv_bytes(self) -> int:
        """K/V bytes in use: blocks held by running requests or kept by the prefix cache."""
        return self.model.kv_bytes()

    def kv_usage(self) -> float:
        """The share of the KV pool held by requests, 0..1 (vllm:kv_cache_usage_perc; as vLLM's, cached blocks nobody
        holds count as free: a new request may evict them)."""
        pool = self.model.pool
        return 1 - pool.available / max(1, pool.blocks)

    def check_fits(self, prompt: list[int]) -> None:
        """A prompt the whole KV budget cannot hold (with its first generated token) is refused."""
        need = -(-(len(prompt) + 1) // BLOCK)
        if need > self.model.pool.blocks:
            raise InvalidRequest(f"the prompt's {len(prompt)} tokens need {need * BLOCK} KV positions; this server's KV "
                                 f"memory holds {self.model.pool.blocks * BLOCK}")

    def can_start(self, prompt: list[int], salt: bytes = b"") -> bool:
        """Whether a request with this prompt could join now: its uncached blocks are free (or evictable). A cached
        block someone holds costs nothing; one nobody holds is counted in `available` (evictable) and leaves it when
        shared, so it costs one as an uncached block does (counting it off the need too counted it twice)."""
        need = -(-(len(prompt) + 1) // BLOCK)
        if self.prefixes is not None:
            pool = self.model.pool
            need -= sum(1 for block in self.prefixes.lookup(prompt, salt) if pool.refs[block] > 0)
        # preempted requests come back first (step's _resume): what they need is not a newcomer's to take
        owed = sum(-(-(len(s.tokens) + 1) // BLOCK) for s in self.running if s.preempted)
        return need + owed <= self.model.pool.available

    def add(self, seq: Sequence) -> Sequence:
        if len(self.running) >= self.max_batch_rows:
            raise RuntimeError("the batch is full: every running request needs a row")
        est = AdaptivePolicy(seq.max_tau, max(seq.max_tau, 1))
        for mine, ours in zip(est.alpha, self.shared.alpha):
            mine.value = ours.value
        if not seq.params.greedy and not isinstance(seq.generator, PositionNoise) and (
                seq.constraint is not None or getattr(self.drafter, "makes_trees", False)):
            seq.generator = PositionNoise.fresh()  # trees and grammars verify by the race rule
        self.check_fits(seq.prompt)
        slot = self.model.acquire_slot()
        try:
            self._state[seq.id] = (slot, fork(self.drafter), est)
            self._load(seq)
            if self.prefixes is not None and seq.prompt_logprobs is None and seq.fed < len(seq.prompt) - 1 \
                    and len(seq.prompt) > BLOCK:
                # the same prompt being prefilled already (n choices, a retry): share its blocks when it is done
                twin = next((r for r in self.running if r.prompt == seq.prompt and r.cache_salt == seq.cache_salt
                             and r.prefilling and r.after is None and r.prompt_logprobs is None), None)
                seq.after = twin.id if twin is not None else None
        except BaseException:  # nothing of a request that could not join stays behind
            self._state.pop(seq.id, None)
            self.model.release_slot(slot)
            raise
        self.running.append(seq)
        return seq

    def _load(self, seq: Sequence) -> None:
        """Put a request's tokens in its empty slot's blocks: the cached prefix shared, the rest reserved (its prefill
        then needs no more memory). Raises blocks.OutOfBlocks, holding nothing, when they do not fit."""
        slot = self._state[seq.id][0]
        seq.fed = 0
        if self.prefixes is not None and (seq.prompt_logprobs is None or seq.cycle > 0):  # (scoring: every row)
            seq.fed = self.prefixes.restore(seq.tokens, slot, seq.cache_salt)
        try:
            self.model.reserve(slot, len(seq.tokens))
            if seq.fed % BLOCK:  # the prefill goes on inside the last shared block: a private copy of it now
                self.model.own(slot, seq.fed // BLOCK)
        except OutOfBlocks:
            self.model.truncate(slot, 0)
            seq.fed = 0
            raise

    def _preempt(self, seq: Sequence) -> None:
        """Free a running request's blocks; it waits, and is recomputed from its tokens when memory allows (its
        output stays what it would have been: a position's K/V depend on the tokens alone)."""
        self.model.truncate(self._state[seq.id][0], 0)
        seq.fed, seq.after, seq.preempted = 0, None, True
        if seq.cycle == 0:  # a prompt being scored is scored again from its first token: what it had goes
            seq.scored = []
        self.preemptions += 1

    def _resume(self) -> None:
        """Preempted requests come back, oldest first, while their tokens fit."""
        for s in sorted((s for s in self.running if s.preempted), key=lambda s: s.id):
            try:
                self._load(s)
            except OutOfBlocks:
                return
            s.preempted = False

    def remove(self, seq: Sequence) -> None:
        """A finished, cancelled or timed-out request leaves: its slot and drafter state are freed."""
        if seq.id in self._state:
            slot, drafter, _ = self._state.pop(seq.id)
            self.model.release_slot(slot)
            close(drafter)
            self.running.remove(seq)

    def _fail(self, seq: Sequence, error: BaseException) -> None:
        """A request whose own work raised leaves the batch with its error; the others go on."""
        seq.finish_reason = "error"
        self.failed.append((seq, error))
        self.remove(seq)

    def close(self) -> None:
        """Give back every slot, and forget the cached prefixes."""
        for seq in list(self.running):
            self.remove(seq)
        self.model.pool.clear_hashes()

    # ---- predicted work (admission) ----------------------------------------------------------------------------
    def calibrate(self, row_ms: float, key_ms: float) -> None:
        self.row_ms, self.key_ms = row_ms, key_ms

    def rows_ms(self, start: int, end: int) -> float:
        """Predicted ms of computing positions start..end-1 of one sequence (a prompt's prefill)."""
        n = max(0, end - start)
        return self._work_scale.value * (n * self.row_ms + self.key_ms * (start + end - 1) * n / 2)

    def uncached(self, prompt: list[int], salt: bytes = b"") -> int:
        """Where the prefill of `prompt` would start: after the blocks the prefix cache holds for it (this tenant's)."""
        if self.prefixes is None:
            return 0
        return min(len(self.prefixes.lookup(prompt, salt)) * BLOCK, max(0, len(prompt) - 1))

    def work_ms(self, start: int, end: int, max_new_tokens: int) -> float:
        """Predicted ms one request adds: prefill of positions start..end-1, then one pass per token, each as long
        as the batch's passes are now (a request's steps share passes with the others' prompt chunks)."""
        step = max(self.pass_ms(len(self.running) + 1), self._recent_pass.value)
        return self.rows_ms(start, end) + max_new_tokens * step

    def request_ms(self, prompt: list[int], max_new_tokens: int) -> float:
        return self.work_ms(self.uncached(prompt), len(prompt), max_new_tokens)

    def backlog_ms(self) -> float:
        """Predicted ms of prefill the running requests still need (preempted ones: all their tokens again)."""
        return sum(self.rows_ms(s.fed, len(s.tokens)) for s in list(self.running) if s.prefilling or s.preempted)

    # ---- the cycle --------------------------------------------------------------------------------------------
    def pass_ms(self, rows: int) -> float:
        from .costs import interpolate
        # a copy first (one C call under the GIL): the event loop asks while the worker adds row counts
        return interpolate({n: e.value for n, e in dict(self._pass).items()}, rows)

    @torch.inference_mode()
    def step(self) -> list[tuple[Sequence, CycleRecord]]:
        """One cycle for every running request -> (request, record) for each request that emitted tokens (a
        request still prefilling emits none). Finished requests leave the batch; so do requests whose own drafting
        or verification raised (listed in `self.failed` with their errors): one request never fails the others."""
        t0 = perf_counter()
        self.last, self.failed = {}, []
        self._resume()
        self._release_twins()
        free = getattr(self.drafter, "free", False)
        early, draft_ms = {}, {}  # request id -> its draft, its drafting ms
        caps, asks = {}, {}  # request id -> most draft rows; what its drafter was asked for and gave (the trace's)
        for s in [s for s in self.running if not s.prefilling and not s.preempted]:
            room = min(s.max_new_tokens - len(s.generated), self.context_window - len(s.tokens))
            caps[s.id] = max(0, min(s.max_tau, room - 1))  # never draft more than can be emitted
            if getattr(self._state[s.id][1], "name", "") == "none":
                caps[s.id] = 0  # target-only: nothing to ask for
            if s.constraint is not None:  # the grammar's forced tokens, then a free drafter's guess: one chain
                t = perf_counter()
                try:
                    early[s.id], drafted = self._constrained_draft(s, room, caps[s.id], free)
                except Exception as e:  # noqa: BLE001
                    self._fail(s, e)
                    continue
                draft_ms[s.id] = (perf_counter() - t) * 1e3
                asks[s.id] = (caps[s.id], drafted, "room", "grammar" if len(early[s.id].tokens) < drafted else "budget",
                              None)
                caps[s.id] = len(early[s.id].tokens)
            elif s.predicted is not None and (made := self._predict(s, room)) is not None:
                early[s.id], draft_ms[s.id], depth = made
                asks[s.id] = (depth, len(early[s.id].tokens), "room", "budget", "prediction")
                caps[s.id] = len(early[s.id].tokens)
            elif free and caps[s.id]:  # propose first: the scheduler then knows what there is to verify
                t = perf_counter()
                try:
                    early[s.id] = self._state[s.id][1].propose(s.tokens, caps[s.id], s.params, s.generator)
                except Exception as e:  # noqa: BLE001
                    self._fail(s, e)
                    continue
                draft_ms[s.id] = (perf_counter() - t) * 1e3
                asks[s.id] = (caps[s.id], len(early[s.id].tokens), "room", "budget", None)
                if early[s.id].is_tree:  # nodes, not depth, are the rows it asks for
                    caps[s.id] = min(len(early[s.id].tokens), self.context_window - len(s.tokens) - 1)
                else:
                    caps[s.id] = min(caps[s.id], len(early[s.id].tokens))
        decoding = [s for s in self.running if not s.prefilling and not s.preempted]
        rows_left = self.max_batch_rows - len(decoding)
        chunks = {}  # prefilling request id -> rows this pass
        for s in self.running:
            if s.prefilling and s.after is None and rows_left > 0:
                chunks[s.id] = min(len(s.tokens) - s.fed, self.prefill_chunk, rows_left)
                rows_left -= chunks[s.id]
        base = self.max_batch_rows - rows_left
        demands = []
        for s in decoding:
            est = self._state[s.id][2]
            cost = 0.0 if free else est.draft_ms.value if est.draft_ms is not None else 0.1
            cap = caps[s.id]
            floor = cap if s.fixed_tau else min(cap, 1) if s.idle >= PROBE_EVERY else 0
            tree = early.get(s.id)
            if asks.get(s.id, ())[-1:] == ("prediction",):  # its own running acceptance, not the drafter's
                demands.append(Demand([s.predicted.acceptance()], 0.0, cap, min(floor, 1)))
                continue
            if tree is not None and tree.is_tree:  # node k's value v_k = Π_{j≤k} α_j: α_k = v_k / v_{k-1}
                v = [1.0] + list(tree.values or [1.0] * len(tree.tokens))
                alphas = [b / a if a > 0 else 0.0 for a, b in zip(v, v[1:])]
                demands.append(Demand(alphas, cost, cap, min(floor, 1)))
                continue
            demands.append(Demand(est.alphas(), cost, cap, floor))
        taus = plan(demands, base, self.max_batch_rows, self.pass_ms)

        for s, tau, d in zip(decoding, taus, demands):
            s.idle = 0 if tau or not d.cap else s.idle + 1
        late = [(s, tau) for s, tau in zip(decoding, taus) if tau and s.id not in early and s.constraint is None]
        if late:  # one batched proposal (the feature draft's layer runs once per step for all of them)
            t = perf_counter()
            made = self._propose_late(late)
            share = (perf_counter() - t) * 1e3 / sum(tau for _, tau in late)  # its time, split by tokens asked
            for (s, tau), draft in zip(late, made):
                if draft is not None:
                    early[s.id], draft_ms[s.id] = draft, share * tau
                    asks[s.id] = (tau, len(draft.tokens), "budget" if tau < caps[s.id] else "room", "budget", None)
        running = {s.id for s in self.running}  # less any whose late drafting failed
        drafts = {}
        for s, tau in zip(decoding, taus):
            if s.id in running:
                d = early.get(s.id)
                if d is not None and d.is_tree:
                    d = prune(d, tau)
                drafts[s.id] = (tau, d, d.tokens[:tau] if d is not None else [])
        self._fit_memory(drafts, chunks)
        t1 = perf_counter()

        tokens, slots, positions, logit_rows, spans, paths = [], [], [], [], {}, []
        for s in self.running:
            if s.id in drafts:
                new = s.tokens[s.fed:] + drafts[s.id][2]
            elif s.id in chunks:
                new = s.tokens[s.fed: s.fed + chunks[s.id]]
            else:
                continue
            start = len(tokens)
            spans[s.id] = (start, len(new))
            if s.id in drafts:
                logit_rows.extend(range(start, start + len(new)))
            elif s.prompt_logprobs is not None and s.cycle == 0:  # scoring the prompt: every row's logits
                logit_rows.extend(range(start, start + len(new)))
            elif s.fed + len(new) == len(s.tokens):  # the prompt's last chunk: its last row gives the first token
                logit_rows.append(start + len(new) - 1)
            tokens += new
            slots += [self._state[s.id][0]] * len(new)
            draft = drafts.get(s.id, (0, None))[1]
            if draft is not None and draft.is_tree and draft.tokens:  # nodes stored after the sequence
                plain, base = len(s.tokens) - s.fed, len(s.tokens)
                positions += list(range(s.fed, base)) + [base - 1 + d for d in depths(draft.parents)]
                paths += [None] * plain + [[base + j for j in path(draft.parents, i)] for i in range(len(draft.tokens))]
            else:
                positions += range(s.fed, s.fed + len(new))
                paths += [None] * len(new)
        if not tokens:
            return []
        try:
            out = self.model.forward(tokens, slots, positions, logit_rows, hidden=self.wants_hidden,
                                     paths=paths if any(q is not None for q in paths) else None)
        except Exception:  # find whose rows the pass cannot run; the others run again next step
            self._isolate(spans, tokens, slots, positions)
            return []
        logits, hidden = (out[0], out[1]) if self.wants_hidden else (out, None)
        logits = fit_vocab(logits, self.vocab_size) if logits is not None else None
        t2 = perf_counter()
        verify_ms = (t2 - t1) * 1e3
        self._pass.setdefault(len(tokens), _Ema(verify_ms, weight=0.0, decay=0.9)).update(verify_ms)
        self._recent_pass.update(verify_ms)
        if len(tokens) >= 16:  # a big pass's time is its rows' work: the prediction's scale follows it
            predicted = len(tokens) * self.row_ms + self.key_ms * sum(positions)
            ratio = verify_ms / predicted if predicted > 0 else 1.0
            self._work_scale.update(min(2.0, max(0.5, ratio)))  # (one pass slowed by the machine moves it a little)

        # every greedy chain's choices in one argmax call over the logit rows (torch's costs ~45 µs a row)
        greedy = any(s.params.greedy and s.constraint is None for s in self.running if s.id in drafts)
        argmax = row_argmax(logits) if greedy and logits is not None else None
        results, row = [], 0
        for s in list(self.running):
            if s.id not in spans:
                continue
            start, n_rows = spans[s.id]
            tau, draft, proposed = drafts.get(s.id, (0, None, []))
            last = s.fed + n_rows == len(s.tokens)
            n_logits = len(proposed) + 1 if s.id in drafts else (
                n_rows if s.prompt_logprobs is not None and s.cycle == 0 else 1 if last else 0)
            block = logits[row: row + n_logits] if n_logits else None
            choice = argmax[row: row + n_logits] if argmax is not None and s.id in drafts else None
            row += n_logits
            try:
                rec = self._finish_cycle(s, start, n_rows, tau, draft, proposed, block, hidden, free,
                                         draft_ms.get(s.id, 0.0), verify_ms, t0, choice,
                                         asks.get(s.id, (0, 0, "budget" if caps.get(s.id) else "room", "budget", None)))
            except Exception as e:  # noqa: BLE001 - this request's verification or stop check: it alone fails
                self._fail(s, e)
                continue
            if rec is not None:
                results.append((s, rec))
        self.last = {"rows": len(tokens), "taus": [drafts[s.id][0] for s in decoding if s.id in drafts],
                     "verify_ms": verify_ms}
        return results

    def _fit_memory(self, drafts: dict, chunks: dict) -> None:
        """Blocks for every row of the pass (prompts have theirs since they joined). When the pool is short, draft
        rows go first, then the newest requests are preempted until the oldest ones' committed rows fit."""
        pool, slot = self.model.pool, lambda s: self._state[s.id][0]  # noqa: E731
        verifying = [s for s in self.running if s.id in drafts]

        def need(drafted: bool) -> int:
            return sum(self.model.blocks_needed(slot(s), len(s.tokens) + (len(drafts[s.id][2]) if drafted else 0))
                       for s in verifying if s.id in drafts)
        if need(True) > pool.available:
            for s in verifying:
                drafts[s.id] = (0, None, [])
            while need(False) > pool.available:
                victim = max((s for s in self.running if not s.preempted), key=lambda s: s.id, default=None)
                if victim is None:
                    raise OutOfBlocks("the KV memory cannot hold the oldest request's next token")
                self._preempt(victim)
                drafts.pop(victim.id, None), chunks.pop(victim.id, None)
        for s in verifying:
            if s.id in drafts:
                self.model.reserve(slot(s), len(s.tokens) + len(drafts[s.id][2]))

    def _release_twins(self) -> None:
        """Requests waiting for a twin's prefill copy its K/V (the prefix cache) once it is done, or prefill
        themselves should the twin have left."""
        ids = {r.id: r for r in self.running}
        for s in self.running:
            twin = ids.get(s.after) if s.after is not None else None
            if s.after is not None and (twin is None or not twin.prefilling):
                s.after = None
                slot = self._state[s.id][0]
                self.model.truncate(slot, 0)
                try:
                    self._load(s)  # the twin's full blocks shared, its own reserved
                except OutOfBlocks:
                    self._preempt(s)
                    continue
                # every block the cache could not give (evicted, or never registered: another request's copies held
                # those hashes) copied from the twin, the last, partial one too; a twin that was preempted has
                # nothing to give, and the request prefills the rest itself
                end = len(s.prompt) - 1  # positions 0..end-1 are the prompt's K/V; the last token is fed next
                if twin is not None and not twin.preempted and twin.fed >= end and s.fed < end:
                    for index in range(s.fed // BLOCK, (end - 1) // BLOCK + 1):
                        self.model.copy_block(self._state[twin.id][0], slot, index)
                    s.fed = end

    def _predict(self, s: Sequence, room: int):
        """The request's prediction's next tokens, as deep as the pass curve pays for -> (draft, ms, depth asked),
        or None when the output is off the prediction (its drafter then proposes as usual)."""
        depth = max(0, min(s.predicted.depth(self.pass_ms), room - 1, self.max_batch_rows - 1))
        if not depth:
            return None
        t = perf_counter()
        draft = s.predicted.propose(s.tokens, depth, s.params, s.generator)
        return (draft, (perf_counter() - t) * 1e3, depth) if draft.tokens else None

    def _constrained_draft(self, s: Sequence, room: int, cap: int, free: bool) -> tuple[Draft, int]:
        """What the grammar forces (drafted for free, unless the request runs without a drafter), then a model-free
        drafter's proposal after it, cut where the grammar would refuse a token -> (that draft, tokens before the
        cut)."""
        drafter = self._state[s.id][1]
        if getattr(drafter, "name", "") == "none":
            return Draft(), 0
        forced = s.constraint.forced(room - 1)
        more = drafter.propose(s.tokens + forced, cap, s.params, s.generator) if free and cap else None
        tokens = forced + (best_chain(more)[:cap] if more is not None else [])
        return Draft(tokens[: s.constraint.valid_prefix(tokens)]), len(tokens)

    def _propose_late(self, late: list[tuple[Sequence, int]]) -> list:
        """Drafts for the requests that draft after the row split, batched; should the batched call raise, each
        request is asked on its own so that only the one whose drafting fails leaves (its draft None)."""
        args = lambda group: ([self._state[s.id][1] for s, _ in group], [s.tokens for s, _ in group],  # noqa: E731
                              [tau for _, tau in group], [s.params for s, _ in group], [s.generator for s, _ in group])
        try:
            return propose_many(*args(late))
        except Exception:  # noqa: BLE001
            made = []
            for s, tau in late:
                try:
                    made.append(propose_many(*args([(s, tau)]))[0])
                except Exception as e:  # noqa: BLE001
                    self._fail(s, e)
                    made.append(None)
            return made

    def _isolate(self, spans, tokens, slots, positions) -> None:
        """After a pass raised: run each request's rows alone; those that still raise fail. When none does on its
        own, the pass's failure is nobody's in particular and is raised (the worker then fails the pass)."""
        blamed = 0
        for s in [s for s in list(self.running) if s.id in spans]:
            start, n = spans[s.id]
            try:
                self.model.forward(tokens[start: start + n], slots[start: start + n], positions[start: start + n], [])
            except Exception as e:  # noqa: BLE001
                self._fail(s, e)
                blamed += 1
        if not blamed:
            raise RuntimeError("a target pass failed, and no request's rows fail on their own")

    def _finish_cycle(self, s: Sequence, start, n_rows, tau, draft, proposed, block, hidden, free, d_ms, verify_ms,
                      t0, argmax=None, ask=(0, 0, "room", "budget", None)) -> CycleRecord | None:
        """Verify, emit and roll back one request after the pass -> its record (None for a prompt chunk). `tau`: the
        rows the scheduler gave its drafts; `ask`: (tokens its drafter was asked for, tokens it gave, why the ask
        fell short of the request's τ, why what it gave was cut, "prediction" when the prediction drafted) for the
        record."""
        fed_before = s.fed
        if s.prompt_logprobs is not None and s.cycle == 0 and block is not None and not proposed:
            targets = s.tokens[s.fed + 1: s.fed + n_rows + 1]  # row i predicts the token after it
            s.scored += token_logprobs(block[: len(targets)], targets, SamplingParams(), s.prompt_logprobs)
            block = block[-1:] if s.fed + n_rows == len(s.tokens) else None
        if block is None:  # a prompt chunk: nothing to emit yet
            s.fed += n_rows
            if hidden is not None:
                self._state[s.id][1].observe_target(fed_before, hidden[start: start + n_rows])
            return None
        if s.cycle == 0 and self.prefixes is not None:  # the prompt is in the slot now
            self.prefixes.store(s.prompt, self._state[s.id][0], s.cache_salt)
        drafter = self._state[s.id][1]
        masked = [] if s.constraint is not None and s.logprobs is not None else None
        if s.constraint is not None:
            n, token = verify_constrained(proposed, block, s.params, s.generator, len(s.tokens), s.constraint, masked)
            nodes = list(range(n))
        elif draft is not None and draft.is_tree and proposed:
            nodes, token = verify_tree(proposed, draft.parents, block, s.params, s.generator, len(s.tokens))
            if nodes:  # the accepted path's K/V to the positions its tokens take
                base = len(s.tokens)
                self.model.move_positions(self._state[s.id][0], [(base + j, base + d) for d, j in enumerate(nodes)])
        else:
            n, token = verify_block(proposed, draft.q if draft is not None else None, block, s.params, s.generator,
                                    len(s.tokens), argmax)
            nodes = list(range(n))
        n = len(nodes)
        if hidden is not None:  # target features of the committed positions (all but the newest token)
            fed = len(s.tokens) - fed_before
            rows = committed_rows(fed, nodes) if draft is not None and draft.is_tree and proposed else range(fed + n)
            drafter.observe_target(fed_before, hidden[[start + r for r in rows]])
        if hasattr(drafter, "observe_verify"):
            drafter.observe_verify(s.tokens, draft, block, nodes)
        emitted, finish = cut([proposed[i] for i in nodes] + [token], s.tokens, len(s.prompt), s.stop,
                              s.max_new_tokens, self.eos_ids, self.context_window)
        s.tokens.extend(emitted)
        s.fed = len(s.tokens) - 1  # the committed prefix stays; the newest token is fed next cycle
        self.model.truncate(self._state[s.id][0], len(s.tokens))  # rejected drafts' blocks back to the pool
        tree = draft is not None and draft.is_tree and bool(proposed)
        limit = 0 if getattr(drafter, "name", "") == "none" else s.max_tau  # the τ this request runs with
        asked, drafted, asked_cut, later_cut, by = ask
        if by == "prediction":  # τ was the depth the pass curve pays for
            limit = asked
            s.predicted.observe_verify(s.tokens, draft, block, nodes)
        rec = CycleRecord(s.cycle, limit, proposed, n, emitted, draft_ms=round(d_ms, 3), verify_ms=round(verify_ms, 3),
                          cycle_ms=round((perf_counter() - t0) * 1e3, 3), finish_reason=finish,
                          parents=draft.parents if tree else None, path=nodes if tree else None,
                          prompt_logprobs=s.scored if s.prompt_logprobs is not None and s.cycle == 0 else None,
                          asked=asked, drafted=drafted,
                          short=shortfall(limit, asked, drafted, len(proposed), asked_cut, later_cut), by=by)
        if s.logprobs is not None:
            rec.logprobs = token_logprobs(choice_rows(block, nodes, tree and s.constraint is None, masked), emitted,
                                          s.params, s.logprobs)
        s.cycle += 1
        if (proposed or not free) and not tree and by is None:  # (a tree's nodes carry the drafter's own estimates)  # a model-free drafter's estimates: over the cycles it proposed in
            self._state[s.id][2].observe(rec)
            self.shared.observe(rec)
        if finish:
            s.finish_reason = finish
            self.remove(s)
        return rec


def measure_pass_curve(model: Llama, sizes=(1, 2, 4, 8, 16, 32, 64), context: int = 64, reps: int = 3
                       ) -> dict[int, float]:
    """Median ms of one pass over n rows, one row per slot up to the largest size (as a batch of decoding
    requests), each slot holding `context` positions; slots the KV budget cannot hold share, a row each at the next
    positions. Sizes are interleaved so machine drift hits all alike."""
    per_slot = -(-(context + max(sizes)) // BLOCK)
    slots = [model.acquire_slot() for _ in range(max(1, min(max(sizes), model.pool.blocks // per_slot)))]
    k = len(slots)
    try:
        with torch.inference_mode():
            for s in slots:
                model.forward(list(range(1, context + 1)), [s] * context, list(range(context)), [])
            times = {n: [] for n in sizes}
            for _ in range(reps + 1):  # the first round warms up
                for n in sizes:
                    t = perf_counter()
                    model.forward([1] * n, [slots[j % k] for j in range(n)], [context + j // k for j in range(n)])
                    times[n].append((perf_counter() - t) * 1e3)
        return lower_envelope({n: median(t[1:]) for n, t in times.items()})
    finally:
        for s in slots:
            model.release_slot(s)
        model.trim()


def lower_envelope(curve: dict[int, float]) -> dict[int, float]:
    """Each size's time at most any larger size's: noise (another process, pages being written back) only ever
    adds time, and a pass over more rows never costs less, so a size slower than a larger one was disturbed."""
    out, best = {}, float("inf")
    for n in sorted(curve, reverse=True):
        best = min(best, curve[n])
        out[n] = best
    return dict(sorted(out.items()))


def measure_row_cost(model: Llama, rows: int = 32, depths=(64, 1024), reps: int = 3) -> tuple[float, float]:
    """(row_ms, key_ms): a prompt row at position p costs about row_ms + key_ms·p, from the median time of a chunk
    of `rows` prompt rows of one sequence at two depths (attention reads every earlier key)."""
    deep = max(2, min(depths[1], model.max_len - rows - 1))
    shallow = max(1, min(depths[0], deep // 4))
    slot = model.acquire_slot()
    try:
        with torch.inference_mode():
            for start in range(0, deep, 256):
                end = min(deep, start + 256)
                model.forward([1] * (end - start), [slot] * (end - start), list(range(start, end)), [])
            per_row = []
            for at in (shallow, deep):
                times = []
                for _ in range(reps + 1):
                    t = perf_counter()
                    model.forward([1] * rows, [slot] * rows, list(range(at, at + rows)), [])
                    times.append((perf_counter() - t) * 1e3 / rows)
                per_row.append(median(times[1:]))
    finally:
        model.release_slot(slot)
    key_ms = max(0.0, (per_row[1] - per_row[0]) / (deep - shallow))
    return max(1e-6, per_row[0] - key_ms * (shallow + rows / 2)), key_ms


def default_budget(curve: dict[int, float], share: float = 0.5) -> int:
    """--max-batch-rows when not given: the largest measured size up to which each added row costs at most `share`
    of a one-row pass (beyond it, a row costs too much to spend on a draft that may be rejected)."""
    sizes = sorted(curve)
    best = sizes[0]
    for a, b in zip(sizes, sizes[1:]):
        if (curve[b] - curve[a]) / (b - a) > share * curve[sizes[0]]:
            break
        best = b
    return best

