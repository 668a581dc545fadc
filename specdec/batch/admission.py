"""Who is in the batch and what memory they hold: joining (a prefix restored, a twin awaited), preemption
and resumption, leaving; and the predicted work admission and the 429 prediction read. BatchEngine's state
(engine.py's __init__) is what these methods read and change."""
from __future__ import annotations

import contextlib
import random
import sys
import traceback
from time import monotonic

from ..drafters.base import close, for_request, fork, idle_step, idle_work, makes_trees
from ..policy import AdaptivePolicy
from ..runtime.blocks import BLOCK, OutOfBlocks
from ..sampling import PositionNoise
from .calibration import NOISE_MS, PassTimer, default_budget, work_beside
from .load import Load, Work, check_fits, prefill_ms
from .requests import Sequence


BUSY = 1.25  # a probe whose one-row pass beside it took this many times the one-row price is a busy moment's: dropped
PROBE_BACKOFF_S = 10.0  # ... and the next probe waits this long (it would take the cores a neighbour is using)
PROBE_POLL_S = 0.5  # an idle worker whose probe waits on the process's own background work looks again this often
SLOW_ONE_TRIES = 3  # a one-row probe above BUSY x the one-row price (timed here, else stored) is believed only on the
# 3rd such probe in a row, each after a back-off: the first idle probe of a fresh Qwen2.5-Coder-1.5B server, beside a
# second server starting, priced one row at 813 ms (stored: 49) and, the curve being nondecreasing, 1-9 rows alike


def _backoff() -> float:
    """How long a dropped probe waits: PROBE_BACKOFF_S, less up to half of it at random (idle servers sharing a
    machine, backing off alike, would retry alike)."""
    return PROBE_BACKOFF_S * random.uniform(0.5, 1.0)


class Admission:
    """BatchEngine's membership and memory (a base class: the engine's cycle is in engine.py)."""

    # ---- membership -------------------------------------------------------------------------------------------
    @property
    def free_rows(self) -> int:
        return self.max_batch_rows - len(self.running)

    @property
    def prefill_full(self) -> bool:
        """Whether as many prompts are being computed as a pass has chunks for (prompts are computed in order of
        arrival; one admitted beyond these would only hold memory and wait)."""
        busy = sum(1 for s in self.running if s.state.value in ("prefilling", "preempted"))
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
        check_fits(prompt, self.model.pool.blocks)

    def can_start(self, prompt: list[int], salt: bytes = b"", scoring: bool = False) -> bool:
        """Whether a request with this prompt could join now: its uncached blocks are free (or evictable). A cached
        block someone holds costs nothing; one nobody holds is counted in `available` (evictable) and leaves it when
        shared, so it costs one as an uncached block does (counting it off the need too counted it twice). A request
        that will wait for a twin needs only what the twin's blocks cannot give it (its last, partial block and its
        first token's): n choices of a long prompt are admitted together, not n times its memory."""
        if self._twin_of(prompt, salt, scoring) is not None:
            need = -(-(len(prompt) + 1) // BLOCK) - len(prompt) // BLOCK + 1
        else:
            need = -(-(len(prompt) + 1) // BLOCK)
            if self.prefixes is not None:
                pool = self.model.pool
                need -= sum(1 for block in self.prefixes.lookup(prompt, salt) if pool.refs[block] > 0)
        # preempted requests come back first (step's _resume): what they need is not a newcomer's to take
        owed = sum(-(-(len(s.tokens) + 1) // BLOCK) for s in self.running if s.preempted)
        return need + owed <= self.model.pool.available

    def _twin_of(self, prompt: list[int], salt: bytes, scoring: bool):
        """The running request (same tenant) prefilling this very prompt, whose K/V a newcomer can copy when it is
        done, or None: no cache, a prompt being scored (every row's logits), a prompt within one block, or one the
        cache already holds whole."""
        if self.prefixes is None or scoring or len(prompt) <= BLOCK \
                or len(self.prefixes.lookup(prompt, salt)) * BLOCK >= len(prompt) - 1:
            return None
        return next((r for r in self.running if r.prompt == prompt and r.cache_salt == salt
                     and r.state.value == "prefilling" and r.prompt_logprobs is None), None)

    def add(self, seq: Sequence) -> Sequence:
        self.owner.check()
        if len(self.running) >= self.max_batch_rows:
            raise RuntimeError("the batch is full: every running request needs a row")
        est = AdaptivePolicy(seq.max_tau, max(seq.max_tau, 1))
        for mine, ours in zip(est.alpha, self.priors(seq.cache_salt).alpha):
            mine.value, mine.n = ours.value, ours.n  # (a position the tenant's requests measured counts as seen)
        if not seq.params.greedy and not isinstance(seq.generator, PositionNoise) and (
                seq.constraint is not None or makes_trees(self.drafter)):
            seq.generator = PositionNoise.fresh()  # trees and grammars verify by the race rule
        self.check_fits(seq.prompt)
        slot = self.model.acquire_slot()
        try:
            self._state[seq.id] = (slot, fork(self.drafter), est)
            for_request(self._state[seq.id][1], seq.cache_salt, (seq.max_new_tokens, self.draft_saving_ms))
            # the same prompt being prefilled already (n choices, a retry): wait, holding no blocks, and copy its K/V
            twin = self._twin_of(seq.prompt, seq.cache_salt, seq.prompt_logprobs is not None)
            seq.join(0 if twin is not None else self._load(seq), twin.id if twin is not None else None)
        except BaseException:  # nothing of a request that could not join stays behind
            self._state.pop(seq.id, None)
            self.model.release_slot(slot)
            raise
        self.running.append(seq)
        return seq

    def _load(self, seq: Sequence) -> int:
        """Put a request's tokens in its empty slot's blocks: the cached prefix shared, the rest reserved (its prefill
        then needs no more memory) -> the positions the cache gave. Raises blocks.OutOfBlocks, holding nothing, when
        they do not fit."""
        slot = self._state[seq.id][0]
        fed = 0
        if self.prefixes is not None and (seq.prompt_logprobs is None or seq.cycle > 0):  # (scoring: every row)
            fed = self.prefixes.restore(seq.tokens, slot, seq.cache_salt)
        if self.prefixes is not None and self.prefixes.features:  # the drafter's share of the cache
            feats = self.prefixes.features_of(seq.tokens, fed, seq.cache_salt) if fed else None
            if feats is not None:
                self._state[seq.id][1].observe_target(0, feats)
            self._prompt_hidden[seq.id] = [feats] if feats is not None else []
        try:
            self.model.reserve(slot, len(seq.tokens))
            if fed % BLOCK:  # the prefill goes on inside the last shared block: a private copy of it now
                self.model.own(slot, fed // BLOCK)
        except OutOfBlocks:
            self.model.truncate(slot, 0)
            raise
        return fed

    def _preempt(self, seq: Sequence) -> None:
        """Free a running request's blocks; it waits, and is recomputed from its tokens when memory allows (its
        output stays what it would have been: a position's K/V depend on the tokens alone)."""
        self.model.truncate(self._state[seq.id][0], 0)
        seq.preempt()
        self.preemptions += 1

    def _resume(self) -> None:
        """Preempted requests come back, oldest first, while their tokens fit."""
        for s in sorted((s for s in self.running if s.preempted), key=lambda s: s.id):
            try:
                s.resume(self._load(s))
            except OutOfBlocks:
                return

    def remove(self, seq: Sequence) -> None:
        """A finished, cancelled, failed or timed-out request leaves. Leaving comes first and cannot fail; then its
        output's blocks are named for the prefix cache, its slot is freed and its drafter closed, each whatever the
        others did. A failure there is the worker's, not a request's: it is printed and counted
        (`cleanup_failures`), the request has left either way, and the worker restarts if they keep coming."""
        self.owner.check()
        state = self._state.pop(seq.id, None)
        if seq in self.running:
            self.running.remove(seq)
        self._prompt_hidden.pop(seq.id, None)
        self._copy_est.pop(seq.id, None)
        if state is None:
            return
        slot, drafter, _ = state
        steps = [lambda: self.model.release_slot(slot), lambda: close(drafter)]
        if self.prefixes is not None and not self.prefixes.features and seq.after is None:
            # its output's blocks too: a conversation's next turn sends this prompt and answer back (the blocks of
            # a feature drafter's cache need hidden states, which only prompts keep)
            steps.insert(0, lambda: self.prefixes.store(seq.tokens[: seq.fed], slot, seq.cache_salt))
        for step in steps:
            self._best_effort(step)

    def _best_effort(self, work) -> None:
        """Bookkeeping no request's answer depends on (naming blocks for the cache, freeing a slot, closing a
        drafter): a failure is printed and counted, never a request's; the worker decides (server/worker.py)."""
        try:
            work()
        except Exception:  # noqa: BLE001
            self.cleanup_failures += 1
            traceback.print_exc(file=sys.stderr)

    def _fail(self, seq: Sequence, error: BaseException) -> None:
        """A request whose own work raised leaves the batch with its error; the others go on (whatever marking it
        finished raises: it leaves first)."""
        self.failed.append((seq, error))
        self.remove(seq)
        with contextlib.suppress(Exception):
            seq.finish("error")

    def close(self) -> None:
        """Give back every slot, and forget the cached prefixes."""
        for seq in list(self.running):
            self.remove(seq)
        if self._timer is not None:
            self._timer.close()
        self.model.pool.clear_hashes()

    def reset(self) -> None:
        """After a worker failure: every request gone, and the KV pool made anew (what a failed cleanup left in it,
        blocks held for nobody or named wrongly, goes with it; cached prefixes are recomputed)."""
        for seq in list(self.running):
            self.remove(seq)
        self.running.clear()
        if self._timer is not None:
            self._timer.close()
        self.model.set_kv_memory(self.model.kv_pool_bytes())  # the same size
        self.cleanup_failures = 0

    # ---- idle time ---------------------------------------------------------------------------------------------
    def idle_work(self) -> int:
        """Work for when no request runs: a model draft's put-off catch-ups (drafters/draft_cache.py)."""
        return idle_work(self.drafter)

    def idle(self) -> bool:
        """One step of that work (the worker calls it only while nothing runs or waits) -> whether any remains."""
        return idle_step(self.drafter)

    def _probe_most(self) -> int:
        return max(self._pass.grid) if self.budget_from_curve else self.max_batch_rows

    def _probe_sizes(self) -> list[int]:
        return self._pass.due(self._probe_most(), monotonic())

    def probe_due(self) -> bool:
        """Whether a pass size is to be timed in idle time (calibration.OnlineCurve.due), not backing off, and with
        none of the process's own background work beside it."""
        return self.probe_wait() == 0.0

    def probe_wait(self) -> float | None:
        """Seconds until a size may be timed (0: now): how long an idle worker may sleep; None without a curve to
        time. A probe held back by a back-off or by background work, or a size falling due again (REPROBE_S), is due
        when that ends, and nothing else wakes the worker then (a server that started beside its vocabulary read
        slept until the first request, then served 8 streams on a stored curve that priced 9-16 rows at 1.3-1.6x
        their time: never bought, never timed)."""
        now = monotonic()
        wait = self._pass.next_due(self._probe_most(), now)
        if wait is None:
            return None
        if wait == 0.0 and work_beside():
            return PROBE_POLL_S
        return max(wait, self._probe_after - now, 0.0)

    def probes_pending(self) -> int:
        """Sizes due to be timed now (/metrics: a benchmark waits for them before it measures a neighbour)."""
        return len(self._probe_sizes())

    def probe(self) -> None:
        """Time one such size (the worker calls it only while nothing runs or waits: a new request waits one pass
        at most; each size once, so the whole cost is one pass per size of the curve). With the row budget read
        off the curve (`budget_from_curve`), the budget is read again once every size is timed: a stored curve
        that priced 2 rows at 30x one row had set it to one row, and kept it there."""
        sizes = self._probe_sizes()
        if not sizes:
            return
        if self._timer is None:
            self._timer = PassTimer(self.model)
        n, priced_one = sizes[0], self._pass(1) if 1 in self._pass.confirmed else None
        busy = lambda ms: ms is not None and ms > BUSY * priced_one + NOISE_MS  # noqa: E731
        checked = priced_one is not None and n > 1  # one-row passes before and after it say whether it was quiet
        if checked and busy(before := self._timer(1)):  # busy now: nothing more is run (a neighbour's cores)
            self._busy_ones += 1
            if self._busy_ones < SLOW_ONE_TRIES:
                self._probe_after = monotonic() + _backoff()
                return
            # busy the third time in a row: the one-row price is what is stale (the machine is slower than when it was
            # timed), not the moment. Judged against it, idle probes never ran again and settled nothing, and three
            # idle servers probing alike took each other for busy neighbours, back-off after back-off
            self._pass.replace(1, before)
            priced_one = before
        self._busy_ones = 0
        ms = self._timer(n) if n > 1 else min(self._timer(1) or 0.0 for _ in range(3)) or None  # (one row: the
        if ms is None:  # fastest of three, with nothing beside it to say whether it was quiet)  # no room in the KV budget now: priced as stored until a pass of it runs
            self._pass.confirmed.add(n)
            self._pass.timed_at[n] = monotonic()
        elif checked and busy(self._timer(1)):
            self._probe_after = monotonic() + _backoff()
        elif n == 1 and ms > BUSY * (priced_one or self._pass.measured[1]) + NOISE_MS \
                and self._slow_ones + 1 < SLOW_ONE_TRIES:  # (nothing beside one row says whether it was quiet)
            self._slow_ones += 1
            self._probe_after = monotonic() + _backoff()
        else:
            self._slow_ones = 0
            self._pass.observe(n, ms, quiet=True)
            if not self._pass.doubted:  # (else it prices this run; what is stored only ever lowers: refined())
                self._pass.probed.add(n)
        if self.budget_from_curve:
            self.max_batch_rows = default_budget(self._pass.values())
        if not self._probe_sizes():
            self._timer.close()
            self._timer = None

    # ---- predicted work (admission) ----------------------------------------------------------------------------
    def calibrate(self, row_ms: float, key_ms: float) -> None:
        self.row_ms, self.key_ms = row_ms, key_ms

    def rows_ms(self, start: int, end: int) -> float:
        """Predicted ms of computing positions start..end-1 of one sequence (a prompt's prefill)."""
        return prefill_ms(self.row_ms, self.key_ms, self._work_scale.value, start, end)

    def uncached(self, prompt: list[int], salt: bytes = b"") -> int:
        """Where the prefill of `prompt` would start: after the blocks the prefix cache holds for it (this tenant's)."""
        if self.prefixes is None:
            return 0
        return min(len(self.prefixes.lookup(prompt, salt)) * BLOCK, max(0, len(prompt) - 1))

    def work(self, start: int, end: int, max_new_tokens: int) -> Work:
        """Predicted (prefill ms, decode ms) of one request: prefill of positions start..end-1, then one pass per
        token, each as long as the batch's passes are now (a request's steps share passes with the others' prompt
        chunks)."""
        return self.rows_ms(start, end), max_new_tokens * self._step_ms()

    def _step_ms(self) -> float:
        return max(self.pass_ms(len(self.running) + 1), self._recent_pass.value)

    def request_ms(self, prompt: list[int], max_new_tokens: int) -> float:
        return sum(self.work(self.uncached(prompt), len(prompt), max_new_tokens))

    def backlog_ms(self) -> float:
        """Predicted ms of prefill the running requests still need (preempted ones: all their tokens again)."""
        return sum(self.rows_ms(s.fed, len(s.tokens)) for s in self.running if s.prefilling or s.preempted)

    def load(self, waiting: tuple[Work, ...] = ()) -> Load:
        """The snapshot other threads predict with (batch/load.py), `waiting` the work of the requests waiting."""
        pool = self.model.pool
        cached = pool.by_hash.keys() if self.prefixes is not None else ()
        if self.prefixes is not None and self.prefixes.features:  # found only with their hidden states
            cached = [d for d in cached if d in pool.kept]
        return Load(self.row_ms, self.key_ms, self._work_scale.value, self._step_ms(), self.backlog_ms(),
                    tuple(waiting), len(self.running), self.max_batch_rows, pool.blocks, frozenset(cached))
