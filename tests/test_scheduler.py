"""The verification-budget scheduler on synthetic acceptance and cost figures."""
import itertools
import random
from dataclasses import replace

from specdec.costs import expected_tokens
from specdec.scheduler import Demand, plan, rate, saved_ms


def curve(per_row=0.3, knee=8, steep=2.0, base=8.0):
    """A pass-time curve shaped like the runtime's: cheap rows up to a knee, dear ones after."""
    return lambda r: base + per_row * min(r, knee) + steep * max(0, r - knee)


def exhaustive(demands, base_rows, budget, pass_ms, overhead):
    best = None
    for taus in itertools.product(*[range(min(d.floor, d.cap), d.cap + 1) for d in demands]):
        if base_rows + sum(taus) > budget and sum(taus) > sum(min(d.floor, d.cap) for d in demands):
            continue
        r = rate(demands, list(taus), base_rows, pass_ms, overhead)
        best = r if best is None else max(best, r)
    return best


def test_plan_matches_exhaustive_search_on_small_cases():
    rng = random.Random(0)
    for case in range(300):
        demands = [Demand([rng.choice([0.0, 0.3, 0.6, 0.9, 1.0]) * rng.random() ** 0.3 for _ in range(4)],
                          rng.choice([0.0, 0.2, 1.5]), rng.randint(0, 4), rng.choice([0, 0, 1]))
                   for _ in range(rng.randint(1, 3))]
        base = len(demands) + rng.choice([0, 3])
        budget = base + sum(min(d.floor, d.cap) for d in demands) + rng.randint(0, 8)
        knees = sorted(rng.uniform(0.05, 4) for _ in range(3))  # any increasing curve, convex or not
        pass_ms = lambda r, k=knees: 5 + k[0] * r + k[1] * max(0, r - 4) + (k[2] if r > 6 else 0)  # noqa: E731
        overhead = rng.choice([0.0, 1.0])
        taus = plan(demands, base, budget, pass_ms, overhead)
        assert base + sum(taus) <= budget
        assert all(min(d.floor, d.cap) <= t <= d.cap for d, t in zip(demands, taus))
        assert abs(rate(demands, taus, base, pass_ms, overhead) - exhaustive(demands, base, budget, pass_ms,
                                                                             overhead)) < 1e-9, case


def test_tau_shrinks_as_load_grows_and_a_never_accepted_draft_gets_no_rows():
    good = Demand([0.8] * 8, draft_ms=0.05, cap=8)
    mean_tau = []
    for n in (1, 4, 16, 32):
        taus = plan([good] * n, n, 64, curve())
        mean_tau.append(sum(taus) / n)
    assert mean_tau[0] >= 4 and mean_tau[0] > mean_tau[1] > mean_tau[2] >= mean_tau[3], mean_tau
    assert mean_tau[-1] == 0  # 32 requests fill the cheap rows by themselves
    hopeless = Demand([0.0] * 8, draft_ms=0.05, cap=8)
    taus = plan([good, hopeless, good], 3, 64, curve())
    assert taus[1] == 0 and min(taus[0], taus[2]) > 0


def test_budget_and_floors():
    fixed = Demand([0.1] * 4, draft_ms=1.0, cap=3, floor=3)  # a fixed τ=3 request drafts 3 if rows allow
    good = Demand([0.9] * 4, draft_ms=0.0, cap=4)
    assert plan([fixed, good], 2, 64, curve())[0] == 3
    taus = plan([fixed, good], 2, 6, curve())
    assert sum(taus) + 2 <= 6 and taus[0] == 3
    assert plan([good, good], 2, 2, curve()) == [0, 0]  # no room beyond the rows the pass carries anyway


def test_a_prompt_chunk_in_the_pass_does_not_make_draft_rows_look_cheap():
    """16 decoding rows past the knee: α = 0.5 drafts do not pay. A 32-row prompt chunk in the same pass emits
    nothing; charged to its prompt, it leaves the choice as it was (charged to the cycle, it bought drafts)."""
    half = Demand([0.5] * 8, draft_ms=0.05, cap=8)
    assert plan([half] * 16, 16, 64, curve()) == [0] * 16
    assert sum(plan([half] * 16, 48, 64, curve())) > 0  # the whole pass charged: the chunk's time dilutes the rows'
    assert plan([half] * 16, 48, 64, curve(), chunk_rows=32) == [0] * 16
    light = Demand([0.9] * 8, draft_ms=0.05, cap=8)  # one request still drafts beside a chunk (its rows past the knee
    assert plan([light], 1, 64, curve()) == [7] and plan([light], 33, 64, curve(), chunk_rows=32) == [6]  # dearer)


def test_a_batched_draft_is_charged_by_its_steps_and_never_priced_below_target_only():
    """Batched model drafts (Demand.batched) cost Σ_k D(n_k): the plan is weighed at that true cost against the same
    plan cut shallower, no draft included, so its rate is never below target-only's or per-token pricing's choice."""
    from specdec.scheduler import draft_time
    rng = random.Random(1)
    for case in range(300):
        n = rng.randint(1, 8)
        demands = [Demand([rng.uniform(0.2, 1.0) for _ in range(6)], 0.0, rng.randint(0, 6),
                          rng.choice([0, 0, 0, 1]), batched=rng.random() < 0.8) for _ in range(n)]
        a, b = rng.uniform(0, 12), rng.uniform(0, 2)
        step = lambda rows, a=a, b=b: a + b * rows  # noqa: E731
        pass_ms = curve(per_row=rng.uniform(0.1, 2), steep=rng.uniform(0.5, 4), base=10.0)
        budget = n + rng.randint(0, 40)
        taus = plan(demands, n, budget, pass_ms, step_ms=step)
        floors, room = [], budget - n  # first come, first served where even the floors do not fit
        for d in demands:
            floors.append(min(d.floor, d.cap, room))
            room -= floors[-1]
        assert n + sum(taus) <= budget
        assert all(f <= t <= d.cap for d, t, f in zip(demands, taus, floors))
        r = rate(demands, taus, n, pass_ms, step_ms=step)
        none = [f if d.batched else t for d, t, f in zip(demands, taus, floors)]
        assert r >= rate(demands, none, n, pass_ms, step_ms=step) * (1 - 1e-9), case
        share = max(1, sum(1 for d in demands if d.batched and d.cap))
        per_token = [Demand(d.alphas, step(share) / share if d.batched else d.draft_ms, d.cap, d.floor)
                     for d in demands]
        naive = plan(per_token, n, budget, pass_ms)
        assert r >= rate(demands, naive, n, pass_ms, step_ms=step) * (1 - 1e-9), case
    # 8 streams, two whose drafts are right 95% of the time, a draft step that costs 40% of a pass whatever its
    # rows: the per-token share (an eighth of a step) drafts 6 deep for those two; the 6 steps, each paid for 2
    # rows, cost more than the tokens they bring, and the plan drafts nothing
    ds = [Demand([0.95] * 6, 0.0, 6, batched=True)] * 2 + [Demand([0.3] * 6, 0.0, 6, batched=True)] * 6
    flat = lambda rows: 60.0 + 0.5 * rows  # noqa: E731
    step = lambda rows: 24.0 + 0.1 * rows  # noqa: E731
    assert plan([Demand(d.alphas, step(8) / 8, d.cap) for d in ds], 8, 64, flat) == [6, 6] + [0] * 6
    assert plan(ds, 8, 64, flat, step_ms=step) == [0] * 8
    assert draft_time(ds, [2, 1, 0, 0, 0, 0, 0, 0], step) == step(2) + step(1)
    assert plan(ds, 8, 64, flat, step_ms=lambda rows: 1.0 + 0.1 * rows)[:2] == [6, 6]  # cheap steps still draft


def test_draft_steps_are_fitted_from_whole_proposals():
    from specdec.costs import DraftSteps
    steps, rng = DraftSteps(), random.Random(2)
    assert steps(4) is None
    for _ in range(40):
        taus = [rng.randint(0, 5) for _ in range(rng.randint(1, 8))]
        depths = [sum(t > k for t in taus) for k in range(max(taus))]
        steps.observe(taus, sum(7.0 + 0.5 * n for n in depths))
    assert abs(steps(1) - 7.5) < 1e-6 and abs(steps(8) - 11.0) < 1e-6
    lone = DraftSteps()  # one request at a time: a step's whole time is its fixed part
    for k in (1, 2, 3, 4, 5):
        lone.observe([k], 9.0 * k)
    assert abs(lone.fit()[0] - 9.0) < 1e-9 and lone.fit()[1] == 0.0


def test_one_stall_does_not_price_a_draft_out_and_a_price_no_proposal_updates_is_forgotten():
    """costs.DraftSteps: a proposal enters as at most CLIP times its price (the pair's 0.5B, whose steps took 15 ms,
    once took 2.2 s in a stall of the shared machine and drafted nothing after it), a lasting change still moves
    the price within a few proposals, and a price no proposal has updated for STALE_S is forgotten."""
    from specdec.costs import DraftSteps
    now = [0.0]
    steps = DraftSteps(clock=lambda: now[0])
    for _ in range(20):
        steps.observe([2], 30.0)
    assert abs(steps(1) - 15.0) < 1e-9
    steps.observe([2], 2189.0)  # one stall
    assert steps(1) < 1.25 * 15.0
    for _ in range(10):  # a lasting slowdown, three times the cost
        now[0] += 1.0
        steps.observe([2], 90.0)
    assert steps(1) > 2 * 15.0  # (as without the clip: DECAY sets the pace)
    now[0] += DraftSteps.STALE_S - 1
    assert steps(1) is not None  # not stale yet
    now[0] += 2
    assert steps.fit() is None and steps(1) is None  # priced by the requests' own estimates until refitted
    for _ in range(DraftSteps.MIN_SEEN):
        steps.observe([1], 9.0)
    assert abs(steps(1) - 9.0) < 1e-9


def test_what_drafting_saves_a_token_shrinks_with_the_load():
    """saved_ms: one stream whose pass commits E tokens saves T(1)·(1 − 1/E) a token; at 8 streams on a machine
    whose 8 rows already cost what more rows do (each further row 1/8 of a pass), drafting saves nothing; between,
    a token's share of the saving falls as the streams grow."""
    knee = lambda rows: 10.0 if rows <= 8 else 1.25 * rows  # noqa: E731
    one = [Demand([0.5] * 4, 0.0, 4, batched=True)]
    taus = plan(one, 1, 64, knee)
    e = 1 + 0.5 + 0.25 + 0.125 + 0.0625
    assert taus == [4] and abs(saved_ms(one, taus, 1, knee) - 10.0 * (1 - 1 / e)) < 1e-9
    assert plan(one * 8, 8, 64, knee) == [0] * 8 and saved_ms(one * 8, [0] * 8, 8, knee) == 0.0
    gentle = lambda rows: 10.0 + 1.0 * rows  # noqa: E731
    saves = [saved_ms(one * n, plan(one * n, n, 64, gentle), n, gentle) for n in (1, 2, 4, 8)]
    assert all(a > b > 0 for a, b in zip(saves, saves[1:])), saves
    # a batched draft's steps are charged: a step dear enough leaves nothing to save, and floors are kept in both
    dear = lambda rows: 50.0  # noqa: E731
    assert saved_ms(one, plan(one, 1, 64, gentle, step_ms=dear), 1, gentle, step_ms=dear) == 0.0
    probe = [Demand([0.5] * 4, 0.0, 4, floor=1, batched=True)]
    assert saved_ms(probe, [1], 1, gentle) == 0.0


def test_a_draft_that_fell_behind_is_charged_its_catch_up_once():
    """Demand.catch_up_ms: a model draft that must first run the tokens a copy drafted is charged that time once when
    it drafts at all. Alone, a good draft still pays for a catch-up; at 8 streams the same catch-up leaves the request
    undrafted while a draft in step is drafted."""
    curve = lambda rows: 20.0 + 0.5 * rows  # noqa: E731
    good = Demand([0.9] * 6, 1.0, 6)
    assert rate([replace(good, catch_up_ms=30.0)], [3], 1, curve) == expected_tokens([0.9] * 6, 3) / (
        curve(4) + 3.0 + 30.0)
    assert plan([replace(good, catch_up_ms=30.0)], 1, 64, curve)[0] > 0  # alone: the tokens it brings pay
    assert plan([replace(good, catch_up_ms=200.0)], 1, 64, curve) == [0]  # a catch-up dearer than any τ brings
    steep = lambda rows: 20.0 + 4.0 * rows  # noqa: E731
    batch = [replace(good, catch_up_ms=30.0)] + [good] * 7
    taus = plan(batch, 8, 64, steep)
    assert taus[0] == 0 and all(t > 0 for t in taus[1:]), taus
