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
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from .costs import expected_tokens


@dataclass
class Demand:
    alphas: list[float]  # acceptance by draft position
    draft_ms: float  # per drafted token
    cap: int  # most draft rows (the request's τ limit, its room left)
    floor: int = 0  # fewest (a request with a fixed τ asks for it)


def rate(demands: list[Demand], taus: list[int], base_rows: int, pass_ms: Callable[[int], float],
         overhead_ms: float = 0.0) -> float:
    tokens = sum(expected_tokens(d.alphas, t) for d, t in zip(demands, taus))
    time = pass_ms(base_rows + sum(taus)) + sum(d.draft_ms * t for d, t in zip(demands, taus)) + overhead_ms
    return tokens / max(time, 1e-9)


def plan(demands: list[Demand], base_rows: int, budget: int, pass_ms: Callable[[int], float],
         overhead_ms: float = 0.0, chunk_rows: int = 0) -> list[int]:
    """τ_i per demand, with base_rows + Σ τ_i ≤ budget (floors are cut first-come when even they do not fit);
    `chunk_rows` of the base rows are prompt chunks (the module's docstring says how they are charged)."""
    if chunk_rows:
        plain, full = pass_ms, pass_ms(base_rows)
        alone = plain(max(1, base_rows - chunk_rows))
        pass_ms = lambda rows: plain(rows) - full + alone  # noqa: E731
    room = max(0, budget - base_rows)
    taus = []
    for d in demands:
        taus.append(min(d.floor, d.cap, room))
        room -= taus[-1]
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
