"""The verification-budget scheduler on synthetic acceptance and cost figures."""
import itertools
import random

from specdec.scheduler import Demand, plan, rate


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
