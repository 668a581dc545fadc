"""The one cost model (policy, the batch scheduler, analyze, tune, distill's report and the benchmarks read it): the
target's verify curve T_verify(n), expected tokens per cycle, and the predicted speedup over target-only decoding,
priced on the proposals a drafter actually makes (how many tokens per cycle, early stops, empty ones).

E[tokens](τ) = 1 + Σ_{k≤τ} Π_{j≤k} α_j; time(τ) = τ·c_draft + T_verify(τ+1) + overhead (Leviathan et al. 2023 with
a measured verify curve instead of a flat one).
"""
from __future__ import annotations

from collections import deque
from statistics import mean, median
from time import monotonic, perf_counter

import torch

from typing import TYPE_CHECKING

if TYPE_CHECKING:  # annotations only: the trace module reads this one's interpolate
    from .trace import CycleRecord


def verify_curve(records: list[CycleRecord], skip_prefill: bool = True) -> dict[int, float]:
    """Mean verify time by tokens verified (drafts + 1), made non-decreasing. Cycle 0 is left out (skip_prefill):
    it includes the prompt prefill."""
    by_n: dict[int, list[float]] = {}
    for r in records[1:] if skip_prefill and len(records) > 1 else records:
        by_n.setdefault(len(r.proposed) + 1, []).append(r.verify_ms)
    return non_decreasing({n: mean(v) for n, v in by_n.items()}, {n: len(v) for n, v in by_n.items()})


def non_decreasing(values: dict[int, float], weights: dict[int, float]) -> dict[int, float]:
    """The weighted least-squares non-decreasing fit (pool adjacent violators): more rows never cost less, and a
    size seen once cannot drag the sizes seen often."""
    blocks = []  # [value, weight, sizes]
    for n in sorted(values):
        blocks.append([values[n], weights[n], [n]])
        while len(blocks) > 1 and blocks[-2][0] > blocks[-1][0]:
            v2, w2, n2 = blocks.pop()
            v1, w1, n1 = blocks.pop()
            blocks.append([(v1 * w1 + v2 * w2) / (w1 + w2), w1 + w2, n1 + n2])
    return {n: v for v, _, sizes in blocks for n in sizes}


def interpolate(curve: dict[int, float], n: int) -> float:
    """T_verify(n): measured, or linear between the measured sizes around n; below the smallest, along the first
    two; above the largest, along the whole curve's mean slope (steadier than the last two points' noise)."""
    if n in curve:
        return curve[n]
    xs = sorted(curve)
    if len(xs) == 1:
        return curve[xs[0]]
    if n > xs[-1]:
        slope = max(0.0, (curve[xs[-1]] - curve[xs[0]]) / (xs[-1] - xs[0]))
        return curve[xs[-1]] + slope * (n - xs[-1])
    lo = max([x for x in xs if x < n], default=xs[0])
    hi = min([x for x in xs if x > n], default=xs[-1])
    if lo == hi:
        lo, hi = xs[0], xs[1]
    return max(0.0, curve[lo] + (curve[hi] - curve[lo]) * (n - lo) / (hi - lo))


def expected_tokens(alphas: list[float], tau: int) -> float:
    """E[tokens per cycle] = 1 + Σ_{k≤τ} Π_{j≤k} α_j; positions past the measured ones reuse the last α."""
    total, reach = 1.0, 1.0
    for k in range(tau):
        reach *= alphas[min(k, len(alphas) - 1)] if alphas else 0.0
        total += reach
    return total


def cost_model(alphas, tau, draft_ms_per_token, curve, overhead_ms, t_target, match_rate=1.0):
    """Predicted speedup over target-only: E[tokens](τ) · T_target(1) / (τ·c + T_verify(τ+1) + overhead).
    `match_rate` < 1 is for drafters that sometimes propose nothing (n-gram without a match): those cycles
    make one token for one plain target step."""
    return predicted_speedup([(1 - match_rate, 0, alphas), (match_rate, tau, alphas)], (0.0, draft_ms_per_token),
                             curve, overhead_ms, t_target)


def predicted_speedup(blocks, draft_cost: tuple[float, float], curve, overhead_ms, t_target) -> float:
    """The speedup over target-only of a drafter whose cycles come as `blocks`: (share of cycles, tokens proposed
    L, acceptance by position in those cycles). Early stops and empty proposals are blocks of their own; acceptance
    is kept per block because a drafter that stops early when unsure is also right more often when it goes on. A
    proposal of L costs draft_cost[0] + draft_cost[1]·L ms and its verification T_verify(L + 1):

        Σ_b w_b·E[tokens](α_b, L_b) · T_target(1) / (Σ_b w_b·(a + b·L_b + T_verify(L_b + 1)) + overhead)
    """
    a, b = draft_cost
    tokens = sum(w * expected_tokens(alphas, n) for w, n, alphas in blocks)
    time = sum(w * ((a + b * n if n else a) + interpolate(curve, n + 1)) for w, n, alphas in blocks)
    return tokens * t_target / max(time + overhead_ms, 1e-9)


def blocks_at(blocks, tau_seen: int, tau: int):
    """The blocks a drafter would give at τ, from those it gave at tau_seen: longer proposals cut to τ; for a larger
    τ, proposals that filled tau_seen are assumed to go on (an estimate: they were cut, not stopped), their
    acceptance at the new positions no better than at their last one."""
    return [(w, min(n, tau) if tau <= tau_seen or n < tau_seen else tau, alphas) for w, n, alphas in blocks]


def best_tree_size(values: list[float], cost) -> int:
    """How many nodes of a best-first tree (values in decreasing order, drafters/tree.py) to verify: the n that
    maximises expected tokens per unit of time, (1 + Σ_{i≤n} v_i) / cost(n + 1), cost(rows) a pass's time."""
    best, best_rate, tokens = 0, 1.0 / max(cost(1), 1e-9), 1.0
    for n, v in enumerate(values, 1):
        tokens += v
        rate = tokens / max(cost(n + 1), 1e-9)
        if rate > best_rate:
            best, best_rate = n, rate
    return best


class RecentMedian:
    """The median of the last `n` values: one value slowed by another process (or a cold first pass) is outvoted, and
    a slow moment is forgotten n/2 values later (an average with a decay of 0.8 still read a 3 s pass as 600 ms)."""

    def __init__(self, n: int, first: float | None = None):
        self.values = deque([] if first is None else [first], maxlen=n)

    def update(self, x: float) -> None:
        self.values.append(x)

    @property
    def value(self) -> float:
        return median(self.values)

    def __len__(self) -> int:
        return len(self.values)


class PassCosts:
    """A target's verify curve as one engine measures it, pass by pass: what trees are sized by. Each size is priced
    at the median of its last WINDOW passes, so a pass slowed by another process is outvoted, and a size priced in a
    busy moment is priced afresh once it runs again (an average kept the moment: with a decay of 0.9, 40 passes to
    forget a pass timed 50x slow). Until two sizes have been seen MIN_SEEN times, the prior: each added row costs
    PRIOR_ROW of a one-row pass (the hardware note in docs/trees.md: about a third on 2 CPU cores, either numerics
    mode)."""
    PRIOR_ROW = 0.35
    MIN_SEEN = 3
    WINDOW = 5

    def __init__(self):
        self.recent: dict[int, RecentMedian] = {}

    def observe(self, rows: int, ms: float) -> None:
        self.recent.setdefault(rows, RecentMedian(self.WINDOW)).update(ms)

    def __call__(self, rows: int) -> float:
        known = {n: v.value for n, v in self.recent.items() if len(v) >= self.MIN_SEEN}
        if len(known) < 2:
            base = known.get(1) or next(iter(known.values()), 1.0) / (1 + self.PRIOR_ROW * (min(known, default=1) - 1))
            return base * (1 + self.PRIOR_ROW * (rows - 1))
        return interpolate(non_decreasing(known, {n: len(self.recent[n]) for n in known}), rows)


@torch.inference_mode()
def measure_verify_curve(model, vocab: int, prompt_ids: list[int], max_n: int, reps: int = 9) -> dict[int, float]:
    """Median ms of one target pass over n new tokens after a cached prompt, n = 1..max_n."""
    from .kv import cached_model
    lm = cached_model(model, vocab)
    lm.forward(prompt_ids)
    g = torch.Generator().manual_seed(0)
    for n in (1, max_n):  # warm-up
        lm.forward(prompt_ids + [1] * n, n)
        lm.rollback(len(prompt_ids))
    times = {n: [] for n in range(1, max_n + 1)}
    for _ in range(reps):  # sizes interleaved, so drift in machine load hits every size alike
        for n in times:
            extra = torch.randint(0, vocab, (n,), generator=g).tolist()
            t0 = perf_counter()
            lm.forward(prompt_ids + extra, n)
            times[n].append((perf_counter() - t0) * 1e3)
            lm.rollback(len(prompt_ids))
    return {n: median(t) for n, t in times.items()}


class DraftSteps:
    """A batched draft's step time by the rows it runs, D(n) = a + b·n, fitted online from whole proposals: a
    proposal that ran steps with n_1, n_2, … rows took Σ_k D(n_k) = a·K + b·Σ_k n_k (least squares over the recent
    proposals, each weighted DECAY^age). A step over many requests costs one weight read, not one per request: what
    the verification budget must charge when it weighs a model draft against the rows it saves (scheduler.plan).

    A price that stops drafting is never timed again, so two rules keep one bad moment from pricing a draft out for
    good. A proposal enters as at most CLIP times what the fit priced it at: on the pair, one 2.2 s stall of the
    shared machine (a 2-step proposal that takes 30 ms) took the 0.5B's step from 17.5 ms to 54.7 and it drafted
    nothing for the 17 requests after it; a lasting change still moves the price, up to CLIP-fold a proposal. And a
    fit that no proposal has updated for STALE_S is forgotten: the requests' own estimates price drafting until
    MIN_SEEN new proposals are fitted."""
    DECAY = 0.95
    MIN_SEEN = 4
    CLIP = 3.0
    STALE_S = 30.0

    def __init__(self, clock=monotonic):
        self._clock = clock
        self._reset()

    def _reset(self) -> None:
        self._m = [[0.0, 0.0], [0.0, 0.0]]  # Σ w·x xᵀ, x = (K, Σn)
        self._v = [0.0, 0.0]  # Σ w·x·ms
        self.seen, self._last = 0, None

    def observe(self, taus: list[int], ms: float) -> None:
        """One proposal: the depth each request drafted, and the ms its steps took (catch-ups left out)."""
        x = (max(taus, default=0), sum(taus))
        if not x[0] or ms <= 0:
            return
        ab = self.fit()
        priced = ab[0] * x[0] + ab[1] * x[1] if ab is not None else 0.0
        if priced > 0:
            ms = min(ms, self.CLIP * priced)
        self._last = self._clock()
        for r in range(2):
            self._v[r] = self.DECAY * self._v[r] + x[r] * ms
            for c in range(2):
                self._m[r][c] = self.DECAY * self._m[r][c] + x[r] * x[c]
        self.seen += 1

    def fit(self) -> tuple[float, float] | None:
        """(a, b) in ms, both ≥ 0; None until MIN_SEEN proposals. Where the depths seen cannot tell a from b (every
        proposal one request), a step's whole time is put on its fixed part a: the dearer reading for a lone row's
        siblings, the right one for a lone row."""
        if self._last is not None and self._clock() - self._last > self.STALE_S:
            self._reset()
        if self.seen < self.MIN_SEEN:
            return None
        (p, q), (_, r) = self._m
        det = p * r - q * q
        if det > 1e-9 * p * r:
            a = (r * self._v[0] - q * self._v[1]) / det
            b = (p * self._v[1] - q * self._v[0]) / det
            if a >= 0 and b >= 0:
                return a, b
            if b < 0:
                return self._v[0] / p, 0.0
            return 0.0, self._v[1] / r
        return (self._v[0] + self._v[1]) / (p + q), 0.0

    def __call__(self, rows: int) -> float | None:
        ab = self.fit()
        return None if ab is None else ab[0] + ab[1] * rows
