"""Trace records say what was asked of the drafter, what it gave and why fewer drafts than τ were verified (engine
and batch engine alike), and the analyzer reads a drafter that rarely proposes as such, not as a τ choice."""
import pytest
import torch
from test_policy_analyze import T

from specdec import models
from specdec.analyze import _unexplained, analyze
from specdec.api import SpecDecoder
from specdec.batch import BatchEngine, Sequence
from specdec.drafters import NgramDrafter
from specdec.drafters.base import NoDrafter
from specdec.sampling import SamplingParams
from specdec.trace import SHORTFALLS, CycleRecord, shortfall

PROMPT = "the cat sat on the mat. the cat sat on the"


@pytest.fixture(scope="module")
def rt(tiny_dirs):
    return models.load(tiny_dirs["target"], backend="runtime")


def check_record(r: CycleRecord, tau: int) -> None:
    """What each field must say, whichever engine wrote it."""
    assert r.tau == tau and r.asked <= tau and r.drafted >= 0
    assert r.short in (None, *SHORTFALLS)
    if r.asked < tau:  # a free drafter is asked for all the room allows: only the room cuts the ask
        assert r.short == "room"
    if r.short is None:
        assert len(r.proposed) >= tau
    elif r.short == "room":
        assert r.asked < tau
    elif r.short == "no_match":
        assert r.asked == tau and r.drafted == 0 and not r.proposed
    elif r.short == "drafter":
        assert r.asked == tau and 0 < r.drafted < tau
    else:  # budget or grammar: it gave all that was asked, fewer were verified
        assert r.drafted >= r.asked == tau and len(r.proposed) < tau


def test_engine_records_what_was_asked_and_why_fewer_were_verified(rt):
    model, tok = rt
    sd = SpecDecoder.from_models(model, tok, draft="ngram", tau=3)
    records = sd.generate(PROMPT, max_new_tokens=40, chat=False).records
    for r in records:
        check_record(r, 3)
    shorts = {r.short for r in records}
    assert "no_match" in shorts and any(r.drafted for r in records)  # it proposed in some cycles, not in others
    assert all(r.asked == 3 for r in records[:-3])  # the room left cuts the ask only near the end
    none = SpecDecoder.from_models(model, tok, draft="none").generate(PROMPT, max_new_tokens=8, chat=False).records
    assert all(r.tau == 0 and r.asked == 0 and r.short is None for r in none)  # target-only asks for nothing


@pytest.mark.parametrize("rows", [64, 1])
def test_batch_records_say_the_same_and_name_the_budget(rt, rows):
    """The batch engine's record carries the request's τ (not the rows the scheduler gave), so a cycle with no
    n-gram match reads `no_match`; with a budget of one row a pass has no room for drafts: `budget`."""
    model, tok = rt
    engine = BatchEngine(model, NgramDrafter(), model.config.vocab_size, {2}, 128, max_batch_rows=rows)
    seq = engine.add(Sequence(tok(PROMPT).input_ids, 30, SamplingParams(), max_tau=3))
    records = []
    while engine.running:
        records += [r for s, r in engine.step() if s is seq]
    for r in records[1:]:
        check_record(r, 3)
    shorts = {r.short for r in records[1:]}
    assert "no_match" in shorts
    none = BatchEngine(model, NoDrafter(), model.config.vocab_size, {2}, 128, max_batch_rows=rows)
    alone = none.add(Sequence(tok(PROMPT).input_ids, 6, SamplingParams(), max_tau=3))
    plain = []
    while none.running:
        plain += [r for s, r in none.step() if s is alone]
    assert all(r.tau == 0 and r.asked == 0 and r.short is None for r in plain)  # target-only asks for nothing
    if rows == 1:  # what the drafter gave was cut to nothing: by the budget, or it had stopped early anyway
        assert not any(r.proposed for r in records) and any(r.drafted for r in records)
        assert {r.short for r in records[1:] if r.drafted} <= {"budget", "drafter"}
    else:
        assert any(r.proposed for r in records)


def test_shortfall_takes_the_first_cause_in_the_cycles_order():
    assert shortfall(3, 3, 3, 3) is None
    assert shortfall(0, 0, 0, 0) is None
    assert shortfall(3, 1, 1, 1) == "room"
    assert shortfall(3, 2, 2, 0, asked_cut="budget") == "budget"  # the scheduler asked for fewer
    assert shortfall(3, 3, 0, 0) == "no_match"
    assert shortfall(3, 3, 2, 0) == "drafter"  # stopped early, whatever was cut after
    assert shortfall(3, 3, 3, 1, later_cut="grammar") == "grammar"
    assert shortfall(3, 3, 5, 2) == "budget"


def server_like(no_match=81, full=14, one=7, alphas=(0.8, 0.6, 0.5), seed=0, step=T):
    """The issue's server trace: τ=3, the drafter proposes in 21 of 102 cycles (14 full, 7 of one token)."""
    rng = torch.Generator().manual_seed(seed)
    kinds = ["none"] * no_match + ["full"] * full + ["one"] * one
    order = torch.randperm(len(kinds), generator=rng).tolist()
    recs = []
    for i, j in enumerate(order):
        kind = kinds[j]
        k = {"none": 0, "full": 3, "one": 1}[kind]
        n = 0
        while n < k and torch.rand(1, generator=rng).item() < alphas[n]:
            n += 1
        verify = step * (1 + 0.06 * k)
        recs.append(CycleRecord(i + 1, 3, [5] * k, n, [5] * (n + 1), 0.1, round(verify, 3), round(verify + 0.6, 3),
                                asked=3, drafted=k, short=shortfall(3, 3, k, k)))
    return recs


def test_a_drafter_that_rarely_proposes_is_named_as_such_not_as_tau():
    rep = analyze(server_like(), decode_only=True)
    s = rep["summary"]
    assert s["tau"] == 3 and s["asked_cycles"] == 102
    assert s["proposal_rate"] == pytest.approx(21 / 102, abs=1e-3)
    assert s["shortfalls"] == {"no_match": 81, "drafter": 7}
    assert rep["bottleneck"] == "rare_proposals"
    first = rep["findings"][0]
    assert first["kind"] == "rare_proposals" and "21 of the 102 cycles" in first["finding"]
    assert "A+B" in first["recommendation"]
    # a longer τ is credited only to the 14 proposals that filled it: worth far less than proposing at all
    gains = {f["kind"]: f["speedup_if_fixed"] for f in rep["findings"]}
    assert gains.get("tau_too_small", 0) < gains["rare_proposals"]
    assert "67% of the proposals filled it" in next(f["finding"] for f in rep["findings"] if f["kind"] == "tau_too_small")
    assert abs(rep["speedup"]["prediction_error"]) < 0.10 and rep["speedup"]["unexplained"] is None
    # its ceiling: proposing in every cycle as it does when it proposes
    assert first["speedup_if_fixed"] > 1.5 * rep["speedup"]["measured"]


def test_target_only_has_nothing_to_diagnose():
    recs = [CycleRecord(i + 1, 0, [], 0, [5], 0.0, T, T + 0.5, asked=0, drafted=0) for i in range(50)]
    rep = analyze(recs, decode_only=True)
    assert rep["bottleneck"] == "none" and rep["summary"]["proposal_rate"] is None


def test_the_same_cycles_written_the_old_way_were_read_as_tau():
    """Before: the batch engine wrote τ as the tokens proposed; 81 cycles said τ=0 and the analyzer advised τ=3."""
    old = [CycleRecord(r.cycle, len(r.proposed), r.proposed, r.accepted, r.emitted, r.draft_ms, r.verify_ms,
                       r.cycle_ms) for r in server_like()]
    assert analyze(old, decode_only=True)["summary"]["tau"] == 0  # what the new fields are there to fix


def test_a_longer_tau_is_credited_only_to_proposals_tau_cut():
    def trace(drafted):
        recs = []
        for i in range(200):
            verify = T * 1.03
            recs.append(CycleRecord(i + 1, 1, [5], 1, [5, 5], 0.1, verify, verify + 0.5, asked=1, drafted=drafted,
                                    short=None))
        return recs
    cut = analyze(trace(drafted=1), decode_only=True)  # always right, always filling τ=1: go longer
    assert cut["bottleneck"] == "tau_too_small" and "100% of the proposals filled it" in cut["findings"][0]["finding"]


def test_the_cycles_the_cost_model_cannot_explain_are_named():
    recs = server_like()
    recs[40].cycle_ms += 5 * T  # one cycle slowed by something outside the model
    got = _unexplained(recs, (0.0, 0.1), {1: T, 2: T * 1.06, 4: T * 1.18}, 0.6)
    assert got["cycles"][0]["cycle"] == recs[40].cycle and got["gap_ms"] == pytest.approx(5 * T, rel=0.05)
    assert f"cycle {recs[40].cycle}" in got["finding"]


def test_a_miss_in_tokens_not_time_is_named_as_such():
    """Proposals of many lengths, each seen in a few cycles, accepted whole (a prediction's copy): the cycles take
    the time their lengths predict, so the cost model's miss is named in the tokens, with both counts."""
    recs = []
    for i in range(60):
        n = 2 + (i % 12) * 2 if i % 3 else 3  # short ones half-rejected, long ones accepted whole
        accepted = 1 if i % 3 == 0 else n
        verify = T * (1 + 0.05 * n)
        recs.append(CycleRecord(i + 1, n, [5] * n, accepted, [5] * (accepted + 1), 0.1, verify, verify + 0.5,
                                asked=n, drafted=n))
    rep = analyze(recs, decode_only=True)
    found = rep["speedup"]["unexplained"]
    assert found is not None and "emitted" in found["finding"] and "ms in all" in found["finding"]
    assert abs(found["gap_ms"]) < 1.0
