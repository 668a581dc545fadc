"""The verification budget: how many draft rows τ_i each running request gets in the next shared target pass.

One pass carries R0 rows anyway (each request's newest token, prompt chunks being prefilled) and at most `budget`
rows in all. The scheduler picks τ_i in [floor_i, cap_i] to maximise committed tokens per second of the cycle:

    rate(τ) = Σ_i E_i(τ_i) / (T(R0 + Σ_i τ_i) + Σ_i c_i·τ_i + overhead)

with E_i(τ) = 1 + Σ_{k≤τ} Π_{j≤k} α_ij (costs.expected_tokens; α_ij request i's acceptance at draft position j),
T the measured pass time by rows, c_i request i's draft cost per token.

Prompt chunks in the pass (P of the R0 rows) emit nothing whatever τ is, and their time is their prompts' own: the
cycle is charged T(R0 − P) + T(R0 + S) − T(R0), what the decoding rows cost alone plus what drafts add on top of
the chunks. (Charging the whole pass made a chunk-laden cycle's tokens look dear and its draft rows cheap: on
Qwen2.5-1.5B at 16 streams the cycles with a 32-row chunk drafted ~17 rows that the chunk-free ones refused.)

Exact, by Dinkelbach's method for ratio objectives: for λ = the best rate so far, maximise
Σ_i [E_i(τ_i) − λ·c_i·τ_i] − λ·T(R0 + S) over the total S. For a fixed S the sum is separable and each term is
concave in τ_i (its increments Π_{j≤k} α_ij − λ·c_i never increase, as α ≤ 1), so the S largest increments
overall are optimal. λ then becomes the rate of the best choice, until it stops growing. Under light load every
request drafts as deep as its acceptance pays for; as rows get dear, the least likely draft positions go first,
and a request whose drafts are never accepted gets none.

A model draft that fell behind its request (a copy drafted the last tokens, not the model) first runs the tokens it
missed: Demand.catch_up_ms, charged once when τ_i > 0. Under load that is what made the pair's 0.5B lose to
target-only: at 8 streams its catch-ups after copied stretches were half its drafting time.

A batched model draft (Demand.batched) is not charged per token: one step drafts for every request still drafting
at that depth, so its time is Σ_k D(n_k), n_k the requests with τ_i ≥ k and D the draft's step time by rows
(costs.DraftSteps). That sum is not separable; Dinkelbach runs with the average share D(n)/n per token, and the
choice is then weighed at its true cost against the same choice cut to every shallower depth K, K = 0 (no model
draft at all: target-only's rate) included. So drafting is chosen only where it is priced to beat not drafting.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace

from .costs import expected_tokens


@dataclass
class Demand:
    alphas: list[float]  # acceptance by draft position
    draft_ms: float  # per drafted token
    cap: int  # most draft rows (the request's τ limit, its room left)
    floor: int = 0  # fewest (a request with a fixed τ asks for it)
    batched: bool = False  # drafted by one batched model step with the others (charged by step_ms, not draft_ms)
    catch_up_ms: float = 0.0  # what its draft must run first, once, when τ > 0 (tokens it did not draft: a copy's)
    valued: bool = False  # its alphas are its draft's own values (a tree's nodes), not measured acceptance


def rate(demands: list[Demand], taus: list[int], base_rows: int, pass_ms: Callable[[int], float],
         overhead_ms: float = 0.0, step_ms: Callable[[int], float] | None = None) -> float:
    tokens = sum(expected_tokens(d.alphas, t) for d, t in zip(demands, taus))
    time = pass_ms(base_rows + sum(taus)) + overhead_ms + draft_time(demands, taus, step_ms)
    return tokens / max(time, 1e-9)


def draft_time(demands: list[Demand], taus: list[int], step_ms: Callable[[int], float] | None = None) -> float:
    """The drafting a choice costs: per token, and for batched demands (with `step_ms`) Σ_k step_ms(n_k)."""
    own = sum(d.draft_ms * t for d, t in zip(demands, taus) if step_ms is None or not d.batched)
    own += sum(d.catch_up_ms for d, t in zip(demands, taus) if t)
    if step_ms is None:
        return own
    depths = [t for d, t in zip(demands, taus) if d.batched and t]
    return own + sum(step_ms(sum(t > k for t in depths)) for k in range(max(depths, default=0)))


def plan(demands: list[Demand], base_rows: int, budget: int, pass_ms: Callable[[int], float],
         overhead_ms: float = 0.0, chunk_rows: int = 0, step_ms: Callable[[int], float] | None = None) -> list[int]:
    """τ_i per demand, with base_rows + Σ τ_i ≤ budget (floors are cut first-come when even they do not fit);
    `chunk_rows` of the base rows are prompt chunks; `step_ms` a batched draft's step time by rows (the module's
    docstring says how both are charged)."""
    pass_ms = _chunks_apart(pass_ms, base_rows, chunk_rows)
    priced = demands
    if step_ms is not None and (n := sum(1 for d in demands if d.batched and d.cap)):
        priced = [replace(d, draft_ms=step_ms(n) / n) if d.batched else d for d in demands]  # the average share
    best = _caught_up(priced, base_rows, budget, pass_ms, overhead_ms)
    if step_ms is None or not any(d.batched and t for d, t in zip(demands, best)):
        return best
    floors = _floors(demands, max(0, budget - base_rows))
    return _shallowest_best(demands, best, floors, base_rows, pass_ms, overhead_ms, step_ms)


def saved_ms(demands: list[Demand], taus: list[int], base_rows: int, pass_ms: Callable[[int], float],
             chunk_rows: int = 0, step_ms: Callable[[int], float] | None = None) -> float:
    """ms per committed token that the batched demands' drafting in `taus` saves, against the same pass with no
    batched draft (their floors kept): 1/rate(without) − 1/rate(with), never below 0. One stream whose draft makes
    a pass commit s tokens saves T(1)·(1 − 1/s) a token; n streams share each pass, so a token's share of the saving
    shrinks with the load (what a draft model's catch-up on a prompt is weighed against: drafters/draft_cache.py)."""
    pass_ms = _chunks_apart(pass_ms, base_rows, chunk_rows)
    without = [min(d.floor, t) if d.batched else t for d, t in zip(demands, taus)]
    r0 = rate(demands, without, base_rows, pass_ms, step_ms=step_ms)
    r1 = rate(demands, taus, base_rows, pass_ms, step_ms=step_ms)
    return max(0.0, 1.0 / max(r0, 1e-12) - 1.0 / max(r1, 1e-12))


def _chunks_apart(pass_ms, base_rows: int, chunk_rows: int):
    """The pass time a cycle is charged when `chunk_rows` of its base rows are prompt chunks (the module's docstring)."""
    if not chunk_rows:
        return pass_ms
    full, alone = pass_ms(base_rows), pass_ms(max(1, base_rows - chunk_rows))
    return lambda rows: pass_ms(rows) - full + alone


def _floors(demands: list[Demand], room: int) -> list[int]:
    taus = []
    for d in demands:
        taus.append(min(d.floor, d.cap, room))
        room -= taus[-1]
    return taus


def _caught_up(demands, base_rows, budget, pass_ms, overhead_ms) -> list[int]:
    """The best choice with catch-ups (a fixed cost, not concave in τ): the best with them left out, then each
    drafting demand with a catch-up dropped to its floor where that raises the rate, the dearest first; the rows
    dropped go to the others."""
    free = [replace(d, catch_up_ms=0.0) for d in demands]
    best = _dinkelbach(free, base_rows, budget, pass_ms, overhead_ms)
    dropped = []
    for i in sorted((i for i, d in enumerate(demands) if d.catch_up_ms and best[i] > d.floor),
                    key=lambda i: -demands[i].catch_up_ms):
        cut = best[:i] + [demands[i].floor] + best[i + 1:]
        if rate(demands, cut, base_rows, pass_ms, overhead_ms) > rate(demands, best, base_rows, pass_ms, overhead_ms):
            best = cut
            dropped.append(i)
    if not dropped:
        return best
    kept = [replace(d, cap=min(d.cap, d.floor)) if i in dropped else d for i, d in enumerate(free)]
    again = _dinkelbach(kept, base_rows, budget, pass_ms, overhead_ms)
    r = lambda taus: rate(demands, taus, base_rows, pass_ms, overhead_ms)  # noqa: E731
    return again if r(again) > r(best) else best


def _dinkelbach(demands, base_rows, budget, pass_ms, overhead_ms) -> list[int]:
    """The best choice with every draft charged per token (the module's docstring)."""
    taus = _floors(demands, max(0, budget - base_rows))
    room = max(0, budget - base_rows) - sum(taus)
    steps = []  # (value at λ=0, cost, request): the chance that each further row's draft is accepted
    for i, (d, t) in enumerate(zip(demands, taus)):
        reach = 1.0
        for k in range(d.cap):
            reach *= d.alphas[min(k, len(d.alphas) - 1)] if d.alphas else 0.0
            if k >= t:
                steps.append((reach, d.draft_ms, i))
    rows0 = base_rows + sum(taus)
    best, lam = list(taus), rate(demands, taus, base_rows, pass_ms, overhead_ms)
    for _ in range(50):  # converges in a handful of rounds
        gains = sorted(((v - lam * c, i) for v, c, i in steps), key=lambda g: -g[0])[:room]
        total, top, top_s = 0.0, -lam * pass_ms(rows0), 0
        for s, (g, _) in enumerate(gains, 1):
            total += g
            value = total - lam * pass_ms(rows0 + s)
            if value > top + 1e-12:
                top, top_s = value, s
        choice = list(taus)
        for _, i in gains[:top_s]:
            choice[i] += 1
        r = rate(demands, choice, base_rows, pass_ms, overhead_ms)
        if r <= lam * (1 + 1e-12):
            break
        best, lam = choice, r
    return best


def _shallowest_best(demands, choice, floors, base_rows, pass_ms, overhead_ms, step_ms) -> list[int]:
    """`choice` with its batched demands cut to depth K (never below their floors), for the K whose true rate
    (batched steps charged by step_ms) is highest; the shallower of equals."""
    top, best = None, choice
    for depth in range(max(choice) + 1):
        cut = [max(f, min(t, depth)) if d.batched else t for d, t, f in zip(demands, choice, floors)]
        r = rate(demands, cut, base_rows, pass_ms, overhead_ms, step_ms)
        if top is None or r > top * (1 + 1e-9):
            top, best = r, cut
    return best
