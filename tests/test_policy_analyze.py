"""τ policies and the trace analyzer, on synthetic records with controlled acceptance and timings."""
import json
import random

import pytest
from tiny import VOCAB, reference_greedy

from specdec.analyze import analyze
from specdec.cli import main
from specdec.drafters import ModelDrafter, NgramDrafter
from specdec.engine import Engine
from specdec.policy import AdaptivePolicy, FixedPolicy, HeuristicPolicy, make_policy
from specdec.sampling import SamplingParams
from specdec.trace import CycleRecord, write_jsonl

T = 60.0  # ms, one target step


def synthetic(alphas, tau, draft_ms=0.6, verify=lambda n: T, other_ms=0.5, cycles=300, empty_every=0, seed=0):
    """Cycles whose acceptance follows alphas (by position, the last one repeats) and whose costs are given."""
    rng = random.Random(seed)
    recs = []
    for i in range(cycles):
        k = 0 if empty_every and i % empty_every == 0 else tau
        n = 0
        while n < k and rng.random() < alphas[min(n, len(alphas) - 1)]:
            n += 1
        d, v = draft_ms * k, verify(k + 1)
        recs.append(CycleRecord(i, tau, [5] * k, n, [5] * (n + 1), round(d, 3), round(v, 3),
                                round(d + v + other_ms, 3)))
    return recs


CASES = {
    "none": dict(alphas=[0.9, 0.85, 0.5, 0.15], tau=4),
    "low_acceptance": dict(alphas=[0.1], tau=2),
    "draft_cost": dict(alphas=[0.6], tau=3, draft_ms=0.5 * T),
    "verify_cost": dict(alphas=[0.7], tau=4, verify=lambda n: T * (1 + 0.5 * (n - 1)), empty_every=5),
    "overhead": dict(alphas=[0.8, 0.7, 0.5], tau=3, other_ms=0.8 * T),
    # drafting and verifying rejected tokens both cost: cutting tau gains more than removing either cost alone
    "tau_too_large": dict(alphas=[0.9, 0.1], tau=8, draft_ms=0.1 * T, verify=lambda n: T * (1 + 0.1 * (n - 1)),
                          empty_every=5),
    "tau_too_small": dict(alphas=[0.95], tau=1),
}


@pytest.mark.parametrize("expected", list(CASES))
def test_analyzer_names_the_right_bottleneck(expected):
    rep = analyze(synthetic(**CASES[expected]))
    assert rep["bottleneck"] == expected, rep["findings"]
    assert abs(rep["speedup"]["prediction_error"]) < 0.1  # the cost model of what the drafter did
    if expected != "none":
        first = rep["findings"][0]
        assert first["kind"] == expected and first["recommendation"]
        if expected != "low_acceptance":  # the headline is the largest counterfactual gain
            assert first["speedup_if_fixed"] == max(f["speedup_if_fixed"] for f in rep["findings"])


def test_analyzer_numbers():
    rep = analyze(synthetic(alphas=[0.8], tau=4, empty_every=4, verify=lambda n: T + n))
    alphas = rep["acceptance_by_position"]
    assert all(abs(a - 0.8) < 0.08 for a in alphas)
    assert rep["costs"]["target_step_ms"] == pytest.approx(T + 1)
    assert rep["costs"]["verify_ms_by_tokens"] == {"1": T + 1, "5": T + 5}
    assert rep["time_split"]["draft_frac"] + rep["time_split"]["verify_frac"] + rep["time_split"]["other_frac"] \
        == pytest.approx(1, abs=1e-3)
    assert rep["speedup"]["measured"] > 1.5  # ~3.4 tokens per ~1.05 target steps


def test_analyze_cli(tmp_path, capsys):
    path = tmp_path / "t.jsonl"
    write_jsonl(synthetic(**CASES["tau_too_large"]), path)
    assert main(["analyze", str(path), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["bottleneck"] == "tau_too_large"
    assert main(["analyze", str(path)]) == 0
    assert "bottleneck: tau_too_large" in capsys.readouterr().out
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"foo": 1}\n')
    assert main(["analyze", str(bad)]) == 2
    assert "not a specdec trace" in capsys.readouterr().err
    assert main(["analyze", str(tmp_path / "missing.jsonl")]) == 2
    (tmp_path / "empty.jsonl").write_text("")
    assert main(["analyze", str(tmp_path / "empty.jsonl")]) == 2
    (tmp_path / "no-traces").mkdir()
    capsys.readouterr()
    assert main(["analyze", str(tmp_path / "no-traces")]) == 2
    assert "no trace files" in capsys.readouterr().err


def test_verify_cost_advice_says_a_smaller_tau_only_where_one_would_help():
    """verify_cost with tau above its best: cut tau; at or below its best (a copy accepted whole, a curve that
    charges every row) a smaller tau cannot help, and the advice says the curve is the machine's."""
    too_big = analyze(synthetic(**CASES["verify_cost"]))
    assert too_big["speedup"]["best_tau"] < 4
    assert "a smaller tau" in next(f for f in too_big["findings"] if f["kind"] == "verify_cost")["recommendation"]
    copy = analyze(synthetic(alphas=[1.0], tau=4, verify=lambda n: T * (1 + 0.3 * (n - 1)), empty_every=5))
    assert copy["bottleneck"] == "verify_cost" and copy["speedup"]["best_tau"] >= 4
    said = next(f for f in copy["findings"] if f["kind"] == "verify_cost")["recommendation"]
    assert said.startswith("a smaller tau does not help") and f"tau={copy['speedup']['best_tau']}" in said


def test_a_long_proposals_acceptance_is_grouped_to_fit_a_line(tmp_path, capsys):
    from specdec.analyze import position_groups
    assert position_groups([0.9, 0.8]) == [("1", 0.9), ("2", 0.8)]
    groups = position_groups([0.5] * 8 + [1.0, None, 0.5] + [None] * 5 + [0.25] * 9)
    assert groups[8:] == [("9-16", 0.75), ("17-25", 0.25)]
    assert position_groups([0.5] * 9)[8:] == [("9", 0.5)]
    path = tmp_path / "long.jsonl"
    write_jsonl(synthetic(alphas=[0.99], tau=32, verify=lambda n: T * (1 + 0.05 * (n - 1))), path)
    assert main(["analyze", str(path)]) == 0
    out = capsys.readouterr().out
    assert "17-32" in out and "…" not in out  # every column readable


def test_analyze_a_directory_of_traces_lists_outliers(tmp_path, capsys):
    runs = tmp_path / "traces"
    runs.mkdir()
    for i in range(4):
        write_jsonl(synthetic(**CASES["none"], seed=i), runs / f"ok{i}.jsonl")
    write_jsonl(synthetic(**CASES["overhead"]), runs / "slow.jsonl")
    assert main(["analyze", str(runs), "--json"]) == 0
    rep = json.loads(capsys.readouterr().out)
    assert len(rep["traces"]) == 5 and [o["trace"] for o in rep["outliers"]] == [str(runs / "slow.jsonl")]
    assert rep["summary"]["cycles"] == 5 * 299  # every trace's decode cycles
    assert main(["analyze", str(runs)]) == 0
    assert "outliers" in capsys.readouterr().out


def rec(tau, proposed, accepted, draft_ms=1.0, verify_ms=T, cycle=1):
    return CycleRecord(cycle, tau, [1] * proposed, accepted, [1] * (accepted + 1), draft_ms, verify_ms,
                       draft_ms + verify_ms + 0.1)


def test_fixed_and_heuristic():
    f = FixedPolicy(3)
    assert [f.next_tau() for _ in range(3)] == [3, 3, 3]
    h = HeuristicPolicy(4, max_tau=8)
    taus = []
    for accepted_all in [True, True, True, False, False, True]:
        t = h.next_tau()
        taus.append(t)
        h.observe(rec(t, t, t if accepted_all else 0))
    assert taus == [4, 6, 8, 8, 7, 6] and h.next_tau() == 8
    for _ in range(20):
        h.observe(rec(h.next_tau(), h.next_tau(), 0))
    assert h.next_tau() == 1
    h.start()
    assert h.next_tau() == 4
    with pytest.raises(ValueError):
        make_policy("greedy", 3)


def drive(policy, alphas, cycles=200, draft_ms_per_token=0.5, verify=lambda n: T, seed=0, empty=False):
    rng = random.Random(seed)
    policy.start()
    taus = []
    for i in range(cycles):
        t = policy.next_tau()
        taus.append(t)
        k = 0 if empty else t
        n = 0
        while n < k and rng.random() < alphas[min(n, len(alphas) - 1)]:
            n += 1
        policy.observe(rec(t, k, n, draft_ms=draft_ms_per_token * k, verify_ms=verify(k + 1), cycle=i + 1))
    return taus


def test_adaptive_picks_small_tau_for_draft_good_early_poor_late():
    taus = drive(AdaptivePolicy(6), alphas=[0.9, 0.1, 0.05], draft_ms_per_token=3.0)
    assert max(taus[-100:]) <= 2 and min(taus[-100:]) >= 1


def test_adaptive_picks_large_tau_for_strong_cheap_draft():
    taus = drive(AdaptivePolicy(2, max_tau=8), alphas=[0.97], draft_ms_per_token=0.3)
    assert sum(taus[-100:]) / 100 >= 6


def test_a_draft_position_never_measured_is_read_as_good_as_the_one_before_it():
    """A draft right 0.95 of the time, sized from τ=1: positions 2+ were read at the flat prior (0.6), so a
    dear draft (a 0.5B step: a third of a pass) stayed at 1-2 tokens a cycle and never measured them. Unmeasured,
    they read as position 1; measured, what they are; a position seen 1-4 times no better than the one before."""
    p = AdaptivePolicy(1, max_tau=8)
    for _ in range(20):
        p.observe(rec(1, 1, 1))
    assert p.alphas()[0] > 0.9 and p.alphas()[1:] == [p.alphas()[0]] * 7
    p.observe(rec(2, 2, 1))  # position 2 rejected once: from position 1's value, down
    assert p.alpha[1].n == 1 and p.alphas()[1] < p.alphas()[0] and p.alphas()[2] == p.alphas()[1]
    taus = drive(AdaptivePolicy(1, max_tau=8), alphas=[0.95], draft_ms_per_token=0.3 * T,
                 verify=lambda n: T * (1 + 0.05 * (n - 1)))
    assert sum(taus[-100:]) / 100 >= 3, taus[-20:]  # (6.0; read at the flat prior: 2.0)
    bad = drive(AdaptivePolicy(1, max_tau=8), alphas=[0.95, 0.1], draft_ms_per_token=0.3 * T,
                verify=lambda n: T * (1 + 0.05 * (n - 1)))
    assert max(bad[-100:]) <= 2  # measured poor past position 1: not drafted there


def test_adaptive_stops_paying_for_empty_drafts():
    """An n-gram drafter that never matches: the policy stops asking (τ=0) except for rare probes."""
    taus = drive(AdaptivePolicy(4), alphas=[0.0], empty=True, verify=lambda n: T + 5 * (n - 1))
    assert taus[-100:].count(0) >= 85


def test_adaptive_goes_to_zero_when_speculation_loses():
    taus = drive(AdaptivePolicy(4), alphas=[0.2], draft_ms_per_token=0.4 * T, verify=lambda n: T * (1 + 0.3 * n))
    assert taus[-100:].count(0) >= 85


@pytest.mark.parametrize("policy", ["heuristic", "adaptive"])
def test_policies_stay_lossless(policy, tok, target, draft_close):
    for drafter in [ModelDrafter(draft_close, VOCAB), NgramDrafter()]:
        engine = Engine(target, drafter, VOCAB, set(), 256)
        for prompt in ["Hello world", "abcabcabc"]:
            ids = tok(prompt).input_ids
            got = [t for r in engine.run(ids, 40, SamplingParams(), make_policy(policy, 3)) for t in r.emitted]
            assert got == reference_greedy(target, ids, 40)


def test_short_trace_draft_cost_fit_stays_physical():
    """6 cycles drafting 6 tokens and one drafting 5 (a model draft, τ=6, 48 tokens): the unconstrained fit gave
    76 ms a token and a negative intercept, and the prediction missed the measurement by 31%."""
    draft = [343.7, 287.5, 223.1, 232.8, 254.4, 192.5]
    recs = [CycleRecord(0, 6, [5] * 6, 6, [5] * 7, 436.0, 404.6, 840.7)]
    recs += [CycleRecord(i + 1, 6, [5] * n, n, [5] * (n + 1), d, 130.0, d + 131.0)
             for i, (n, d) in enumerate(zip([6, 6, 6, 6, 6, 5], draft))]
    rep = analyze(recs, target_curve={1: 25.0})
    per_cycle, per_token = rep["costs"]["draft_ms_per_cycle"], rep["costs"]["draft_ms_per_token"]
    assert per_cycle >= 0 and 38 < per_token < 48
    assert abs(rep["speedup"]["prediction_error"]) < 0.05


def test_one_time_work_is_not_priced_per_cycle():
    """A cycle that also does work once (a draft catching up on the prompt, first touches of KV pages) is reported
    as one-time cost; the per-cycle prediction matches the cycles without it."""
    recs = synthetic(alphas=[0.7], tau=3, cycles=60)
    slow = recs[5]
    recs[5] = CycleRecord(slow.cycle, slow.tau, slow.proposed, slow.accepted, slow.emitted, slow.draft_ms + 900,
                          slow.verify_ms, slow.cycle_ms + 900)
    rep = analyze(recs)
    assert abs(rep["speedup"]["one_time_ms"] - 900) < 1
    assert rep["speedup"]["measured"] < rep["speedup"]["measured_per_cycle"]
    assert abs(rep["speedup"]["prediction_error"]) < 0.05
    assert abs(rep["costs"]["draft_ms_per_token"] - 0.6) < 0.01  # the fit did not see the one-time work


def test_adaptive_policy_takes_drafts_longer_than_its_max_tau():
    """A grammar's forced drafts can run past the request's τ limit (the batch engine's estimates observe them):
    the positions it keeps estimates for are updated, the rest ignored (was an IndexError: a 500 for that request)."""
    p = AdaptivePolicy(2, 2)
    p.observe(CycleRecord(1, 2, [5] * 6, 5, [5] * 6, 0.1, T, T + 1))
    assert len(p.alpha) == 2
    assert all(a.value > 0.5 for a in p.alpha)


def test_adaptive_leaves_a_prompt_catch_up_out_of_the_draft_cost():
    """A model draft's first step catches up on the prompt (400 ms here, the record's draft_prefill_ms): paid once,
    so a cheap, accurate draft drafts long chains from the next cycles on. Priced per drafted token it made every
    draft look 400x dearer, and the policy stopped drafting (the 0.5B draft on long prompts)."""
    policy = AdaptivePolicy(3, max_tau=8)
    policy.start()
    first = rec(policy.next_tau(), 3, 3, draft_ms=400.9, cycle=0)
    first.draft_prefill_ms = 400.0
    policy.observe(first)
    assert abs(policy.draft_ms.value - 0.3) < 1e-9
    taus = drive(policy, alphas=[0.97], cycles=30, draft_ms_per_token=0.3)
    assert sum(taus[2:]) / len(taus[2:]) >= 5


def test_a_model_drafts_catch_up_on_the_prompt_is_its_prefill(tok, target, draft_close):
    """ModelDrafter reports the time of a first step over more than CATCHUP_TOKENS unseen tokens as the draft's
    prefill_ms, and no prefill for a step after a verification; the engine's records carry it."""
    from specdec.drafters.model import CATCHUP_TOKENS
    drafter = ModelDrafter(draft_close, VOCAB)
    ids = tok("Hello world, this is a prompt long enough to catch up on").input_ids
    assert len(ids) > CATCHUP_TOKENS
    first = drafter.propose(ids, 3, SamplingParams(), None)
    assert first.prefill_ms > 0
    again = drafter.propose(ids + first.tokens[:1] + [5], 3, SamplingParams(), None)  # one accepted, the target's
    assert again.prefill_ms == 0.0
    engine = Engine(target, ModelDrafter(draft_close, VOCAB), VOCAB, set(), 256)
    recs = list(engine.run(ids, 12, SamplingParams(), make_policy("fixed", 3)))
    assert recs[0].draft_prefill_ms > 0 and all(r.draft_prefill_ms == 0.0 for r in recs[1:])
    assert recs[0].draft_prefill_ms <= recs[0].draft_ms


def test_a_batched_proposals_time_keeps_each_catch_up_with_its_own_request():
    """The batch engine splits a batched proposal's time by the tokens each request asked for, less the catch-ups,
    which stay with the request that made them (one request's long prompt no longer prices the others' drafts)."""
    from specdec.batch.engine import BatchEngine
    from specdec.drafters.base import Draft
    shares = BatchEngine._shares(0.010, [Draft([1, 2], prefill_ms=6.0), Draft([3, 4]), None], [2, 2, 1])
    assert [round(s, 6) for s in shares] == [7.6, 1.6, 0.8]
    assert BatchEngine._shares(0.001, [Draft(prefill_ms=5.0)], [1]) == [5.0]  # a clock coarser than the catch-up


def test_a_trace_under_a_wrong_stored_curve_names_the_curve_not_the_acceptance():
    """The issue's trace: a server whose stored curve priced 2+ rows at ~29 one-row passes never drafted, so every
    pass was one row, and analyze said low_acceptance. With the curve the policy priced (the trace's meta) beside
    the passes it measured, the cause is the curve."""
    from specdec.analyze import analyze
    recs = [rec(3, 0, 0, draft_ms=0.1, verify_ms=30.0, cycle=i + 1) for i in range(40)]
    for r in recs:
        r.asked, r.drafted, r.short = 3, 3, "budget"  # asked, drafted, but the budget bought no rows
    priced = {1: 53.0, 2: 1552.0, 4: 1572.0, 8: 1596.0}
    rep = analyze(recs, target_curve=priced)
    assert rep["bottleneck"] == "stale_costs"
    assert "2-row pass at 1552.0 ms" in rep["findings"][0]["finding"]
    assert analyze(recs)["bottleneck"] != "stale_costs"  # without the priced curve: nothing to compare
    sane = analyze(recs, target_curve={1: 30.0, 2: 31.0, 4: 33.0, 8: 55.0})
    assert sane["bottleneck"] != "stale_costs"
    capped = analyze(recs, target_curve={1: 30.0, 2: 90.0, 4: 180.0})  # a server's cap on that guess: 1.5 a row
    assert capped["bottleneck"] == "stale_costs" and "3.0 one-row passes" in capped["findings"][0]["finding"]
    fixed = [rec(3, 3, 2, draft_ms=0.1, verify_ms=32.0, cycle=i + 1) for i in range(40)]  # a fixed τ: nothing cut
    assert analyze(fixed, target_curve={1: 77.5, 2: 77.5, 4: 77.5})["bottleneck"] != "stale_costs"


def test_requests_whose_draft_was_put_off_are_named():
    """Cycles recorded `put_off` (the batch engine's: a request whose model draft never caught up on its prompt) make
    the bottleneck `put_off` from PUT_OFF_CUT of the cycles, not verify_cost or acceptance."""
    from specdec.analyze import PUT_OFF_CUT, analyze
    recs = [rec(4, 3, 2, cycle=i) for i in range(41)]  # (cycle 0 carries the prompt: not a decode cycle)
    for r in recs[1:11]:
        r.tau, r.proposed, r.accepted, r.emitted, r.asked, r.drafted, r.short = 0, [], 0, [1], 0, 0, "put_off"
    assert 10 >= PUT_OFF_CUT * 40 and analyze(recs)["bottleneck"] == "put_off"
    assert "10 of 40 cycles drafted nothing" in analyze(recs)["findings"][0]["finding"]
    for r in recs[1:11]:
        r.short = "budget"
    assert analyze(recs)["bottleneck"] != "put_off"
