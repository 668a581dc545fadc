"""BatchEngine: one cycle (step) for every running request, sharing one target pass (the package's docstring)."""
from __future__ import annotations

from dataclasses import replace
from time import monotonic, perf_counter

import torch

from ..drafters.base import Draft, catch_up_ms, makes_trees, propose_many, put_off, reconsider
from ..drafters.tenants import PerTenant
from ..drafters.tree import best_chain, depths, path, prune
from ..engine import cut
from ..kernels import argmax as row_argmax
from ..policy import AdaptivePolicy, Ema
from ..runtime.blocks import BLOCK, OutOfBlocks
from ..runtime.model import Llama
from ..runtime.owner import Owner
from ..runtime.slot_cache import fit_vocab
from ..sampling import PositionNoise, SamplingParams, token_logprobs
from ..scheduler import Demand, plan, saved_ms
from ..trace import CycleRecord, shortfall
from ..verification import (
    choice_rows,
    committed_rows,
    verify_block,
    verify_constrained,
    verify_tree,
)
from .admission import Admission
from .hindsight import Hindsight, expected_extra
from .calibration import OnlineCurve, work_beside
from ..costs import DraftSteps, RecentMedian, expected_tokens, interpolate
from ..runtime.prefix_cache import PrefixCache
from .requests import Sequence, State

# A model draft that grows valued trees (the feature draft) proposes before the row split for greedy requests while
# at most this many decode: the scheduler then sizes each tree on the draft's own node values, cycle by cycle, instead
# of on the request's running acceptance (a few rejections had left a request without rows for long stretches of an
# edit that its draft would have copied). A larger batch drafts after the split: a proposal the split then refuses
# costs every request's draft pass.
EARLY_MODEL_BATCH = 4
PROBE_EVERY = 8  # a request denied draft rows this many cycles in a row gets one, to re-measure its acceptance
# (one such probe a pass, the longest denied first, and rarer in a bigger batch: PROBE_EVERY cycles per 4 decoding
# requests. At 16 streams on Qwen2.5-1.5B a probe per request every 8 cycles was 38% of the draft rows, each past
# the pass curve's knee, and each a feature-draft call of ~2 ms)
PROBE_ALPHA = 0.9  # ... and only where the split would grant it rows if its draft were right this often at every
# position: a probe re-measures an acceptance to find rows worth buying, and where even 0.9 buys none the pass is
# only made dearer (Qwen2.5-1.5B at 8 streams: a 9th row costs 20% of an 8-row pass, and the probes put one in a
# quarter of the passes, each ~0.6 of a token: the feature draft's server fell to 0.85x target-only)
RECENT_PASSES = 9  # the passes lately (a request's steps in admission's prediction): their median, whatever their rows
SIZE_PROBE_EVERY = 50  # a pass size priced from a guess or an old time is bought once in this many passes (2%)
COPY_BUCKETS = (2, 4, 8, 16)  # a greedy request's copy: the match length from which each set of its estimates counts
COPY_PRIORS = (0.6, 0.8, 0.9, 0.95)  # (a longer match is likelier to go on, as in suffix decoding), and its prior
# before any request's copies were verified (after that: their running average, BatchEngine.copy_priors)


class BatchEngine(Admission):
    def __init__(self, model: Llama, drafter, vocab_size: int, eos_ids: set[int], context_window: int,
                 max_batch_rows: int = 64, prefill_chunk: int = 32, pass_curve: dict[int, float] | None = None,
                 prefix_cache: bool = True, curve_is_prior: bool = False):
        """`drafter` is the template each request's drafter is forked from (drafters.base.fork); `pass_curve`
        the measured ms of a pass by rows (measure_pass_curve), refined online (`curve_is_prior`: read from the store,
        each size a guess until timed here: calibration.OnlineCurve); `prefix_cache` whether prompts'
        K/V blocks are kept for reuse (with their positions' hidden states for a drafter that reads them). Memory
        is the model's KV pool (Llama.set_kv_memory)."""
        if max_batch_rows < 1 or prefill_chunk < 1:
            raise ValueError("max_batch_rows and prefill_chunk must be >= 1")
        self.model, self.drafter, self.vocab_size = model, drafter, vocab_size
        self.owner = Owner("the batch engine")  # the thread that builds it (a server's worker) runs it alone
        self.eos_ids, self.context_window = set(eos_ids), context_window
        self.max_batch_rows, self.prefill_chunk = max_batch_rows, prefill_chunk
        self.wants_hidden = getattr(drafter, "wants_target_hidden", False)
        self._valued: set[int] = set()  # this cycle's requests whose tree the scheduler sized on its node values
        self.early_model = not getattr(drafter, "free", False) and makes_trees(drafter)  # (EARLY_MODEL_BATCH)
        # a chain that starts with model-free members (`ngram+distilled`) proposes those before the split too: a
        # copy then gets rows for what it holds, and only requests it had nothing for wait on the model draft
        members = getattr(drafter, "members", [])
        self.free_lead = not getattr(drafter, "free", False) and bool(members) and getattr(members[0], "free", False)
        # their copies' acceptance, apart from the model draft's (mixed, the copies' 0.79 a row made the model's
        # 0.45 read 0.71 at 16 streams, and the split bought model rows that lost), and by the copy's match length:
        # request id -> COPY_BUCKETS index -> estimates
        self._copy_est: dict[int, dict[int, AdaptivePolicy]] = {}
        self._copied: dict[int, int] = {}  # this cycle's requests whose draft is such a copy -> its bucket
        self._prefill_ms: dict[int, float] = {}  # this cycle's model drafts' catch-ups (Draft.prefill_ms), by id
        self.prefixes = PrefixCache(model, features=self.wants_hidden) if prefix_cache else None
        self._prompt_hidden: dict[int, list] = {}  # id -> its prompt's hidden states so far (features cache only)
        self.preemptions = 0
        self.cleanup_failures = 0  # a leaving request's cleanup that raised (Admission.remove)
        # the work of a row at position p: row_ms + key_ms·p (attention grows with the keys it reads), scaled by what
        # passes measure (calibrate(), measure_row_cost); what admission predicts finishing times with
        curve = pass_curve or {1: 10.0}
        self.row_ms, self.key_ms = curve[max(curve)] / max(curve), 0.0
        self._work_scale = Ema(1.0, weight=8.0, decay=0.95)  # measured / predicted pass time; calibration = 8 passes
        self._recent_pass = RecentMedian(RECENT_PASSES, min(curve.values()))  # ms of the passes lately, any rows
        self.running: list[Sequence] = []
        self._state: dict[int, tuple] = {}  # id -> (slot, drafter, acceptance estimates)
        self._pass = OnlineCurve(pass_curve or {1: 10.0}, prior=curve_is_prior)
        self.draft_steps = DraftSteps()  # a batched draft's step time by rows (what its drafting is charged)
        self.hindsight = Hindsight()  # the split's expected tokens against the accepted ones, by load (hindsight.py)
        self._split: dict[int, Demand] = {}  # this cycle's demands as estimated, uncorrected, by request id
        self.budget_from_curve = False  # max_batch_rows was read off the curve (default_budget): read again (probe)
        self._timer = None  # the probes' pass timer (Admission.probe), while sizes are left to time
        self._probe_after = 0.0  # no probe before this (monotonic s): backing off a busy moment
        self._slow_ones = 0  # one-row probes in a row timed above BUSY x the one-row price (Admission.probe)
        self._busy_ones = 0  # probes in a row whose one-row pass before them took BUSY x the one-row price
        self._warm_rows: set[int] = set(self._pass.measured) if not curve_is_prior else set()  # row counts run once
        self._passes = 0  # passes planned (SIZE_PROBE_EVERY)
        self._steps = 0  # steps begun
        self._saving = None  # ((step, requests), draft_saving_ms then)
        # acceptance by position over a tenant's requests: its new request's prior (drafters/tenants.py)
        self.priors = PerTenant(lambda: AdaptivePolicy(1, 16))
        # the same for greedy copies, by match length (COPY_BUCKETS): a request's copy estimates start from them
        self.copy_priors = PerTenant(lambda: [AdaptivePolicy(1, 16, prior_alpha=p) for p in COPY_PRIORS])
        self.last = {}  # the last step's figures (rows, taus, verify_ms), for metrics; {} when it ran no pass
        self._priced: dict[int, float] = {}  # the pass curve's prices read this step (pass_ms), from its values then
        self._curve_now: dict[int, float] = {}
        self.failed: list[tuple[Sequence, BaseException]] = []  # the last step's requests that failed on their own
        self.pass_log = None  # called with each pass's record (pass_log.PassLog: `serve --pass-log`)

    # ---- the cycle --------------------------------------------------------------------------------------------
    def pass_ms(self, rows: int) -> float:
        """The pass curve as priced now, each row count read once a pass (the split asks thousands of times a pass,
        and a read of the online curve took 12 µs: 1.2 ms of a 30 ms pass at 8 streams)."""
        ms = self._priced.get(rows)
        if ms is None:
            if not self._priced:
                self._curve_now = self._pass.values()
            ms = self._priced[rows] = interpolate(self._curve_now, rows)
        return ms

    def draft_saving_ms(self) -> float:
        """ms one emitted token is expected to save by a model draft at the batch's load: scheduler.saved_ms for the
        running requests as if each decoded and drafted, its prompt chunks done (the load over the request's life,
        not this pass's). A draft model's catch-up on a prompt is weighed against it (drafters/draft_cache.py)."""
        key = (self._steps, len(self.running))  # (asked by each request not yet drafting, every cycle: once a step)
        if self._saving is not None and self._saving[0] == key:
            return self._saving[1]
        steps = self.draft_steps if self.draft_steps.fit() is not None else None
        demands = []
        for s in self.running:  # (a preempted request too: it runs again before this one is done)
            est = self._state[s.id][2]
            cost = est.draft_ms.value if est.draft_ms is not None else 0.1
            demands.append(Demand(est.alphas(), cost, s.max_tau, batched=True))
        demands = self.hindsight.scaled(demands, len(demands))
        taus = plan(demands, len(demands), self.max_batch_rows, self.pass_ms, step_ms=steps)
        self._saving = (key, saved_ms(demands, taus, len(demands), self.pass_ms, step_ms=steps))
        return self._saving[1]

    def pass_curve_report(self) -> list[tuple[int, float, float, int]]:
        """Per size: the time it started from (stored or measured at start), the time priced now, passes timed."""
        return self._pass.report()

    def refined_pass_curve(self) -> dict[int, float]:
        """The pass curve it started from, refined by the passes it ran (calibration.OnlineCurve.refined)."""
        return self._pass.refined()

    @torch.inference_mode()
    def step(self) -> list[tuple[Sequence, CycleRecord]]:
        """One cycle for every running request -> (request, record) for each request that emitted tokens (a
        request still prefilling emits none). Finished requests leave the batch; so do requests whose own drafting
        or verification raised (listed in `self.failed` with their errors): one request never fails the others."""
        self.owner.check()
        t0 = perf_counter()
        self.last, self.failed, self._priced, self._steps = {}, [], {}, self._steps + 1
        self._resume()
        self._release_twins()
        free = getattr(self.drafter, "free", False)
        early, draft_ms, caps, asks = self._early_drafts(free)  # 1. model-free drafters propose first
        decoding, chunks, taus, demands = self._plan_rows(early, caps, asks, free)  # 2. prompt chunks, draft rows
        drafts = self._late_drafts(decoding, taus, demands, early, draft_ms, caps, asks)  # 3. the others, batched
        self._fit_memory(drafts, chunks)
        t1 = perf_counter()
        tokens, slots, positions, logit_rows, spans, paths = self._pass_rows(drafts, chunks)
        if not tokens:
            return []
        priced = self.pass_ms(len(tokens)) if self.pass_log is not None else None  # (before the pass reprices it)
        made = self._target_pass(tokens, slots, positions, logit_rows, spans, paths, t1, bool(chunks))  # 4. one pass
        if made is None:
            return []
        logits, hidden, verify_ms = made
        t2 = perf_counter()
        results = self._verify_all(drafts, spans, logits, hidden, free, draft_ms, verify_ms, t0, caps, asks)  # 5.
        self._look_back(len(decoding), drafts, results)
        self.last = {"rows": len(tokens), "taus": [drafts[s.id][0] for s in decoding if s.id in drafts],
                     "verify_ms": verify_ms}
        if self.pass_log is not None:
            self.pass_log({"rows": len(tokens), "prompt_rows": sum(chunks.values()), "decoding": len(decoding),
                           "draft_rows": sum(len(d[2]) for d in drafts.values()),
                           "accepted": sum(rec.accepted for _, rec in results),
                           "tree": any(q is not None for q in paths), "verify_ms": verify_ms, "priced_ms": priced,
                           "before_ms": (t1 - t0) * 1e3, "after_ms": (perf_counter() - t2) * 1e3, "t": monotonic()})
        return results

    def _early_drafts(self, free: bool):
        """Proposals made before the row split: a grammar's forced tokens, a prediction, a model-free drafter's
        chain or tree -> (drafts, drafting ms, most draft rows, what each drafter was asked for and gave), by id."""
        early, draft_ms = {}, {}  # request id -> its draft, its drafting ms
        self._copied, self._prefill_ms = {}, {}
        caps, asks = {}, {}  # request id -> most draft rows; what its drafter was asked for and gave (the trace's)
        for s in [s for s in self.running if not s.prefilling and not s.preempted or self._finishing(s)]:
            room = min(s.max_new_tokens - len(s.generated), self.context_window - len(s.tokens))
            caps[s.id] = max(0, min(s.max_tau, room - 1))  # never draft more than can be emitted
            if getattr(self._state[s.id][1], "name", "") == "none":
                caps[s.id] = 0  # target-only: nothing to ask for
            if s.constraint is not None and not free and not s.constraint.forced(1):
                pass  # nothing forced now: the model draft proposes after the split (_late_drafts: one chain, cut)
            elif s.constraint is not None:  # the grammar's forced tokens, then a free drafter's guess: one chain
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
            elif caps[s.id] and (free or self.free_lead):  # propose first: the scheduler then knows what there is
                drafter = self._state[s.id][1]                  # to verify (a chain: its model-free members)
                if getattr(drafter, "sizes_own_depth", False):  # (suffix) as deep as the pass curve pays for
                    caps[s.id] = max(1, min(drafter.depth(self.pass_ms), room - 1, self.max_batch_rows - 1))
                t = perf_counter()
                try:
                    made = drafter.propose(s.tokens, caps[s.id], s.params, s.generator, **(
                        {} if free else {"free_only": True}))
                except Exception as e:  # noqa: BLE001
                    self._fail(s, e)
                    continue
                if not free and not made.tokens:
                    continue  # the chain's model draft proposes later
                if not free:  # (a sampled request's copies share one set: its token follows the match less)
                    self._copied[s.id] = sum(made.match >= b for b in COPY_BUCKETS[1:]) if s.params.greedy else 0
                early[s.id] = made
                draft_ms[s.id] = (perf_counter() - t) * 1e3
                asks[s.id] = (caps[s.id], len(early[s.id].tokens), "room", "budget", None)
                if early[s.id].is_tree:  # nodes, not depth, are the rows it asks for
                    caps[s.id] = min(len(early[s.id].tokens), self.context_window - len(s.tokens) - 1)
                else:
                    caps[s.id] = min(caps[s.id], len(early[s.id].tokens))
        for s in self.running:  # a prompt's last chunk carries only what was drafted now (a model draft needs the
            if s.prefilling and s.id in caps and s.id not in early:  # hidden states this pass computes)
                caps[s.id] = 0
        self._early_model_drafts(early, draft_ms, caps, asks)
        self._valued = {i for i, d in early.items() if d is not None and d.is_tree}  # trees sized on their values
        return early, draft_ms, caps, asks

    def _estimates(self, s: Sequence) -> AdaptivePolicy:
        """The acceptance estimates that size this cycle's draft: a chain's model-free copy has its own."""
        if s.id in self._copied:
            bucket, mine = self._copied[s.id], self._copy_est.setdefault(s.id, {})
            if bucket not in mine:  # a new request's copies start from the running average of earlier ones
                mine[bucket] = AdaptivePolicy(s.max_tau, max(s.max_tau, 1), prior_alpha=COPY_PRIORS[bucket])
                for a, b in zip(mine[bucket].alpha, self.copy_priors(s.cache_salt)[bucket].alpha):
                    a.value = b.value
            return mine[bucket]
        return self._state[s.id][2]

    def _finishing(self, s: Sequence) -> bool:
        """A prompt whose rest fits in one chunk: model-free drafts (a prediction, an n-gram copy) may ride on the
        pass that emits its first token (_plan_rows keeps them if the chunk does take all of the rest)."""
        return s.state is State.PREFILLING and s.constraint is None and len(s.tokens) - s.fed <= self.prefill_chunk \
            and (s.prompt_logprobs is None or s.cycle > 0)

    def _early_model_drafts(self, early: dict, draft_ms: dict, caps: dict, asks: dict) -> None:
        """A tree-growing model draft's proposals for greedy and seeded sampled requests in a small batch
        (EARLY_MODEL_BATCH), in one batched call before the split: their node values are what the scheduler sizes
        them by."""
        decoding = [s for s in self.running if not s.prefilling and not s.preempted]
        if not self.early_model or len(decoding) > EARLY_MODEL_BATCH:
            return
        group = [(s, caps[s.id]) for s in decoding if (s.params.greedy or isinstance(s.generator, PositionNoise))
                 and s.constraint is None and s.id not in early and caps.get(s.id)]
        if not group:
            return
        t = perf_counter()
        made = self._propose_late(group)
        share = self._shares(perf_counter() - t, made, [1] * len(group))
        for (s, depth), draft, ms in zip(group, made, share):
            if draft is None:
                continue
            early[s.id], draft_ms[s.id] = draft, ms
            self._prefill_ms[s.id] = draft.prefill_ms
            asks[s.id] = (depth, len(draft.tokens), "room", "budget", None)
            room = self.context_window - len(s.tokens) - 1
            caps[s.id] = min(len(draft.tokens), room) if draft.is_tree else min(depth, len(draft.tokens))

    def _plan_rows(self, early: dict, caps: dict, asks: dict, free: bool):
        """The rows of the pass: each decoding request's newest token, prompt chunks, then the verification budget's
        split of the rest into draft rows -> (decoding requests, prompt chunks by id, their τ, their demands)."""
        decoding = [s for s in self.running if not s.prefilling and not s.preempted]
        rows_left = self.max_batch_rows - len(decoding)
        chunks = {}  # prefilling request id -> rows this pass
        for s in self.running:
            if s.prefilling and s.after is None and rows_left > 0:
                chunks[s.id] = min(len(s.tokens) - s.fed, self.prefill_chunk, rows_left)
                rows_left -= chunks[s.id]
                if s.id in caps and chunks[s.id] == len(s.tokens) - s.fed:  # its prompt's last chunk, drafts after it
                    decoding.append(s)
        base = self.max_batch_rows - rows_left
        demands = []
        for s in decoding:
            est = self._estimates(s)
            cost = 0.0 if free or s.id in early else est.draft_ms.value if est.draft_ms is not None else 0.1
            cap = caps[s.id]
            floor = cap if s.fixed_tau else 0
            tree = early.get(s.id)
            if asks.get(s.id, ())[-1:] == ("prediction",):  # its own running acceptance, not the drafter's
                demands.append(Demand([s.predicted.acceptance()], 0.0, cap, min(floor, 1)))
                continue
            own = self._state[s.id][1]
            if getattr(own, "sizes_own_depth", False) and s.id in early:  # (suffix) its own acceptance too
                demands.append(Demand([own.acceptance()], 0.0, cap, min(floor, 1)))
                continue
            if tree is not None and tree.is_tree:  # node k's value v_k = Π_{j≤k} α_j: α_k = v_k / v_{k-1}
                v = [1.0] + list(tree.values or [1.0] * len(tree.tokens))
                alphas = [b / a if a > 0 else 0.0 for a, b in zip(v, v[1:])]
                demands.append(Demand(alphas, cost, cap, min(floor, 1), valued=True))
                continue
            late = not free and s.id not in early
            demands.append(Demand(est.alphas(), cost, cap, floor, batched=late,
                                  catch_up_ms=catch_up_ms(own, s.tokens) if late and cap else 0.0))
        self._split = {s.id: d for s, d in zip(decoding, demands)}
        demands = self.hindsight.scaled(demands, len(decoding))  # what rows bought at this load were accepted at
        steps = self.draft_steps if self.draft_steps.fit() is not None else None
        self._probe(decoding, demands, early, base, chunks, steps)
        if not chunks:
            self._size_probe(demands, base)
        for i, s in enumerate(decoding):  # a request whose catch-up was put off drafts nothing late
            own = self._state[s.id][1]
            if demands[i].batched and put_off(own):
                reconsider(own, s.tokens)  # (unless the load fell: its catch-up pays now)
                if put_off(own):
                    demands[i] = replace(demands[i], cap=0, floor=0, batched=False)
                    asks[s.id] = (0, 0, "put_off", "budget", None)  # (its records say so: trace.SHORTFALLS)
        taus = plan(demands, base, self.max_batch_rows, self.pass_ms, chunk_rows=sum(chunks.values()), step_ms=steps)

        return decoding, chunks, taus, demands

    def _look_back(self, decoding: int, drafts: dict, results: list) -> None:
        """The drafted requests' expected extra tokens (as estimated before the correction) against the tokens
        they had accepted: the correction the split reads next at this load (hindsight.py)."""
        expected, accepted = {False: 0.0, True: 0.0}, {False: 0, True: 0}  # by kind (Demand.valued)
        for s, rec in results:
            proposed = drafts.get(s.id, (0, None, []))[2]
            if proposed and s.id in self._split:
                kind = self._split[s.id].valued
                expected[kind] += expected_extra(self._split[s.id], len(proposed))
                accepted[kind] += rec.accepted
        for kind in expected:
            self.hindsight.observe(decoding, expected[kind], accepted[kind], kind)

    def _probe(self, decoding, demands: list[Demand], early: dict, base: int, chunks: dict, steps) -> None:
        """A floor of one row for the request denied rows longest (PROBE_EVERY cycles per 4 decoding requests), where
        the split would grant it rows at PROBE_ALPHA, a model draft's catch-up on the tokens it missed priced in:
        what a re-measured acceptance could change. (Probes once skipped a model draft that had fallen behind: at one
        stream a request whose first drafts missed then never drafted again; Qwen2.5-Coder-1.5B with the 0.5B, a
        completion at 111 passes with drafts on 30 tokens, against 37 passes on another run of the same prompt.)"""
        every = PROBE_EVERY * max(1, -(-len(decoding) // 4))
        denied = [i for i, s in enumerate(decoding)  # (asked every `every` cycles of a request's denial, not each
                  if s.idle >= every and not s.idle % every and demands[i].cap and not s.fixed_tau]  # cycle: a split)
        if not denied:
            return
        i = max(denied, key=lambda i: (decoding[i].idle, -decoding[i].id))
        cap, alone = min(demands[i].cap, self.max_batch_rows - base), len(decoding) / self.pass_ms(base)
        if all((len(decoding) + expected_tokens([PROBE_ALPHA], d) - 1) / self.pass_ms(base + d) <= alone
               for d in range(1, cap + 1)):
            return  # (the split's answer where no other request drafts, at a fraction of its cost)
        hopeful = replace(demands[i], alphas=[PROBE_ALPHA] * demands[i].cap)
        if plan(demands[:i] + [hopeful] + demands[i + 1:], base, self.max_batch_rows, self.pass_ms,
                chunk_rows=sum(chunks.values()), step_ms=steps)[i]:
            demands[i] = replace(demands[i], floor=min(demands[i].cap, 1))

    def _size_probe(self, demands: list[Demand], base: int) -> None:
        """Every SIZE_PROBE_EVERY passes, a pass size the curve prices from a guess or an old time (OnlineCurve.due)
        that the drafts on hand can fill is bought: floors for the likeliest drafts, up to that size. A size priced
        out is then timed in traffic too, at 1 pass in SIZE_PROBE_EVERY (an idle server's probes are dropped while a
        neighbour has the cores); the rows are drafts, verified like any other. A size is bought at most twice the
        pass's own rows, so that the probes cost about one more pass in SIZE_PROBE_EVERY (at 8 streams a 32-row
        pass, 3.6 times an 8-row one, was bought every 50 passes: 5% of the server's time; idle time times the
        larger sizes), or 8 more rows where that is more (a q8 tile's: 9 rows cost ~2 one-row passes)."""
        self._passes += 1
        if self._passes % SIZE_PROBE_EVERY:
            return
        room = min(self.max_batch_rows, base + sum(d.cap - d.floor for d in demands), base + max(base, 8))
        due = [n for n in self._pass.due(room, monotonic()) if n > base + sum(d.floor for d in demands)]
        if not due:
            return
        want = due[0] - base - sum(d.floor for d in demands)
        for i in sorted(range(len(demands)), key=lambda i: -(demands[i].alphas or [0.0])[0]):
            more = min(want, demands[i].cap - demands[i].floor)
            demands[i] = replace(demands[i], floor=demands[i].floor + more)
            want -= more
        for i, d in enumerate(demands):  # exactly that size: a pass of it is what is bought
            demands[i] = replace(d, cap=d.floor)

    def _late_drafts(self, decoding, taus, demands, early, draft_ms, caps, asks) -> dict:
        """The drafts of the requests that draft after the split (one batched call), and every draft cut to its
        τ -> request id -> (τ, draft, proposed tokens)."""
        for s, tau, d in zip(decoding, taus, demands):
            s.idle = 0 if tau or not d.cap else s.idle + 1
        late = [(s, tau) for s, tau in zip(decoding, taus) if tau and s.id not in early]
        if late:  # one batched proposal (the feature draft's layer runs once per step for all of them)
            t = perf_counter()
            made = self._propose_late(late)
            seconds = perf_counter() - t
            share = self._shares(seconds, made, [tau for _, tau in late])
            ran = [d for d in made if d is not None]
            self.draft_steps.observe([tau if d.is_tree else len(d.tokens) for (_, tau), d in zip(late, made)
                                      if d is not None], seconds * 1e3 - sum(d.prefill_ms for d in ran))
            for (s, tau), draft, ms in zip(late, made, share):
                if draft is not None and s.constraint is not None:  # one chain, cut where the grammar refuses
                    chain = best_chain(draft)[:tau]
                    draft = Draft(chain[: s.constraint.valid_prefix(chain)], prefill_ms=draft.prefill_ms, by=draft.by)
                if draft is not None:
                    early[s.id], draft_ms[s.id] = draft, ms
                    self._prefill_ms[s.id] = draft.prefill_ms
                    asks[s.id] = (tau, len(draft.tokens), "budget" if tau < caps[s.id] else "room", "budget", None)
        running = {s.id for s in self.running}  # less any whose late drafting failed
        drafts = {}
        for s, tau in zip(decoding, taus):
            if s.id in running:
                d = early.get(s.id)
                if d is not None and d.is_tree:
                    d = prune(d, tau)
                drafts[s.id] = (tau, d, d.tokens[:tau] if d is not None else [])
        return drafts

    @staticmethod
    def _shares(seconds: float, made: list, weights: list[int]) -> list[float]:
        """A batched proposal's ms per request: each its own catch-up (Draft.prefill_ms), and the rest of the time
        split by `weights` (the tokens each asked for)."""
        own = [d.prefill_ms if d is not None else 0.0 for d in made]
        rest = max(0.0, seconds * 1e3 - sum(own)) / max(1, sum(weights))
        return [rest * w + o for w, o in zip(weights, own)]

    def _pass_rows(self, drafts: dict, chunks: dict):
        """The pass's rows: per request its unfed tokens and drafts (tree nodes after the sequence, each attending
        to its path), or its prompt chunk -> (tokens, slots, positions, logit rows, spans by id, tree paths)."""
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
            if s.id in drafts:  # its newest token's row and its drafts' (a prompt's last chunk: after the chunk)
                logit_rows.extend(range(start + len(new) - len(drafts[s.id][2]) - 1, start + len(new)))
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
        return tokens, slots, positions, logit_rows, spans, paths

    def _target_pass(self, tokens, slots, positions, logit_rows, spans, paths, t1, prompt_rows: bool = False):
        """The one target pass -> (logits, hidden states or None, its ms), or None when it raised (whose rows failed
        leave; the others run again next step). Its time refines the work model, and the pass curve unless it
        carried prompt chunks (`prompt_rows`): the curve prices decode and draft rows, and a chunk's rows read
        long contexts (booked under the pass's rows, a server's own load once priced every size at 8x)."""
        try:
            out = self.model.forward(tokens, slots, positions, logit_rows, hidden=self.wants_hidden,
                                     paths=paths if any(q is not None for q in paths) else None)
        except Exception:  # find whose rows the pass cannot run; the others run again next step
            self._isolate(spans, tokens, slots, positions)
            return None
        logits, hidden = (out[0], out[1]) if self.wants_hidden else (out, None)
        logits = fit_vocab(logits, self.vocab_size) if logits is not None else None
        t2 = perf_counter()
        verify_ms = (t2 - t1) * 1e3
        # a process's first pass of a row count is a cold one (code and buffers first touched: a 4-row pass timed at
        # 200 ms beside 21 ms one-row passes, priced 4+ rows out), and one beside its own background work shared the
        # cores (calibration.background_work): both left out
        if len(tokens) in self._warm_rows:
            self._recent_pass.update(verify_ms)  # (prompt rows included: a request's steps share those passes)
            if not prompt_rows and not work_beside():
                self._pass.observe(len(tokens), verify_ms)
                self._priced = {}
        self._warm_rows.add(len(tokens))
        if len(tokens) >= 16:  # a big pass's time is its rows' work: the prediction's scale follows it
            predicted = len(tokens) * self.row_ms + self.key_ms * sum(positions)
            ratio = verify_ms / predicted if predicted > 0 else 1.0
            self._work_scale.update(min(2.0, max(0.5, ratio)))  # (one pass slowed by the machine moves it a little)
        return logits, hidden, verify_ms

    def _verify_all(self, drafts, spans, logits, hidden, free, draft_ms, verify_ms, t0, caps, asks) -> list:
        """Each request verifies its rows, emits and rolls back (_finish_cycle) -> (request, record) pairs."""
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
        return results

    def _keep_prompt_hidden(self, s: Sequence, start: int, hidden: torch.Tensor) -> None:
        """A prompt's hidden states, kept until its blocks are named with them (runtime/prefix_cache.py's features)."""
        if self.prefixes is not None and self.prefixes.features and s.cycle == 0:
            kept = self._prompt_hidden.setdefault(s.id, [])
            if sum(len(h) for h in kept) == start:  # in order (a preempted prompt starts again from _load's)
                kept.append(hidden)

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
        """Requests waiting for a twin's prefill share its K/V (the prefix cache) once it is done, or prefill
        themselves should the twin have left."""
        ids = {r.id: r for r in self.running}
        for s in [s for s in self.running if s.after is not None]:
            twin = ids.get(s.after)
            if twin is not None and twin.state == State.PREFILLING:
                continue
            slot = self._state[s.id][0]
            try:
                fed = self._load(s)  # the twin's full blocks shared, its own reserved
            except OutOfBlocks:
                self._preempt(s)
                continue
            # every block the cache could not give (evicted, or never registered: another request's copies held
            # those hashes) copied from the twin, the last, partial one too; a twin that was preempted has nothing
            # to give, and the request prefills the rest itself (as it does with a features cache: copied blocks
            # would come without the hidden states its drafter needs)
            end = len(s.prompt) - 1  # positions 0..end-1 are the prompt's K/V; the last token is fed next
            if twin is not None and not twin.preempted and twin.fed >= end and fed < end \
                    and not self.prefixes.features:
                for index in range(fed // BLOCK, (end - 1) // BLOCK + 1):
                    self.model.copy_block(self._state[twin.id][0], slot, index)
                fed = end
            s.release(fed)

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
        """What the grammar forces (drafted for free, unless the request runs without a drafter), then the drafter's
        proposal after it, cut where the grammar would refuse a token -> (that draft, tokens before the cut). A model
        draft continues the forced tokens within the cap, and only while at most EARLY_MODEL_BATCH requests decode:
        it runs for this request alone, before the row split."""
        drafter = self._state[s.id][1]
        if getattr(drafter, "name", "") == "none":
            return Draft(), 0
        forced = s.constraint.forced(room - 1)
        ask = cap if free else cap - len(forced) if len(self.running) <= EARLY_MODEL_BATCH else 0
        more = drafter.propose(s.tokens + forced, ask, s.params, s.generator) if ask > 0 else None
        tokens = forced + (best_chain(more)[:cap] if more is not None else [])
        by = (more.by or drafter.name) if more is not None and more.tokens else None
        return Draft(tokens[: s.constraint.valid_prefix(tokens)], by=by), len(tokens)

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
            s.advance(n_rows)
            if hidden is not None:
                self._state[s.id][1].observe_target(fed_before, hidden[start: start + n_rows])
                self._keep_prompt_hidden(s, fed_before, hidden[start: start + n_rows])
            return None
        if s.cycle == 0 and self.prefixes is not None:  # the prompt is in the slot now
            feats = None
            if self.prefixes.features:
                self._keep_prompt_hidden(s, fed_before, hidden[start: start + len(s.prompt) - fed_before])
                kept = self._prompt_hidden.pop(s.id, [])
                feats = torch.cat(kept) if kept else None
            self._best_effort(lambda: self.prefixes.store(s.prompt, self._state[s.id][0], s.cache_salt, feats))
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
            if draft is not None and draft.is_tree and proposed:
                drafter.observe_target(fed_before, hidden[[start + r for r in committed_rows(fed, nodes)]])
            else:  # (a chain's committed rows are the first ones: a view, not a gather)
                drafter.observe_target(fed_before, hidden[start: start + fed + n])
        if hasattr(drafter, "observe_verify"):
            drafter.observe_verify(s.tokens, draft, block, nodes)
        emitted, finish = cut([proposed[i] for i in nodes] + [token], s.tokens, len(s.prompt), s.stop,
                              s.max_new_tokens, self.eos_ids, self.context_window)
        s.emit(emitted)  # the committed prefix stays; the newest token is fed next cycle
        self.model.truncate(self._state[s.id][0], len(s.tokens))  # rejected drafts' blocks back to the pool
        tree = draft is not None and draft.is_tree and bool(proposed)
        limit = 0 if getattr(drafter, "name", "") == "none" else s.max_tau  # the τ this request runs with
        asked, drafted, asked_cut, later_cut, by = ask
        if by == "prediction":  # τ was the depth the pass curve pays for
            limit = asked
            s.predicted.observe_verify(s.tokens, draft, block, nodes)
        rec = CycleRecord(s.cycle, limit, proposed, n, emitted, draft_ms=round(d_ms, 3), verify_ms=round(verify_ms, 3),
                          draft_prefill_ms=round(self._prefill_ms.get(s.id, 0.0), 3),
                          cycle_ms=round((perf_counter() - t0) * 1e3, 3), finish_reason=finish,
                          parents=draft.parents if tree else None, path=nodes if tree else None,
                          prompt_logprobs=s.scored if s.prompt_logprobs is not None and s.cycle == 0 else None,
                          cached_tokens=s.cached if s.cycle == 0 else 0,
                          asked=asked, drafted=drafted,
                          short=shortfall(limit, asked, drafted, len(proposed), asked_cut, later_cut),
                          by=by or ((draft.by or getattr(drafter, "name", None)) if proposed else None))
        if s.logprobs is not None:
            rec.logprobs = token_logprobs(choice_rows(block, nodes, tree and s.constraint is None, masked), emitted,
                                          s.params, s.logprobs)
        s.cycle += 1
        # a model-free drafter's estimates: over the cycles it proposed in; trees sized on their own node values
        # (proposed before the split) leave them to the chains; a model draft's trees drafted after the split (sized
        # on these estimates) count as chains of their depth
        if (proposed or not free) and by is None and not (tree and s.id in self._valued):
            seen = replace(rec, proposed=proposed[: max(depths(draft.parents))]) if tree else rec
            self._estimates(s).observe(seen)
            if s.id in self._copied:
                self.copy_priors(s.cache_salt)[self._copied[s.id]].observe(seen)
            else:
                self.priors(s.cache_salt).observe(seen)
        if finish:
            s.finish(finish)
            self.remove(s)
        return rec
