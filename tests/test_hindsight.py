"""The row split in hindsight (batch/hindsight.py): rows bought on estimates that verification then accepted less
often are bought at that rate next, where 2+ requests decode; a lone request is measured, not corrected."""
from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from specdec import SpecDecoder, models
from specdec.batch import BatchEngine, Sequence
from specdec.batch.hindsight import FLOOR, Hindsight, expected_extra, level
from specdec.drafters.base import Draft
from specdec.policy import Ema
from specdec.scheduler import Demand, plan
from specdec.sampling import SamplingParams


@pytest.fixture(scope="module")
def rt(tiny_dirs):
    return models.load(tiny_dirs["target"], backend="runtime")


class WrongDraft:
    """Proposes a token the target never picks next (from a reference run): accepted at 0."""
    name, free = "wrong", False

    def __init__(self, references: list[list[int]], vocab: int):
        self.references, self.vocab = references, vocab

    def propose(self, context, k, params, generator):
        ref = next(r for r in self.references if r[:len(context)] == context and len(r) > len(context))
        return Draft([(ref[len(context)] + 1) % self.vocab] * k)


def run(rt, n: int, tokens: int = 48):
    """`n` greedy requests drafted by WrongDraft whose acceptance estimates are reset to 0.95 at every position after
    every cycle, rows priced at a fifth of a one-row pass ->
    draft rows per pass, the engine; every output checked against the request alone."""
    model, tok = rt
    prompts = [f"abcabc {i} " * 3 for i in range(n)]
    sd = SpecDecoder.from_models(model, tok, draft="none")
    refs = [tok(p).input_ids + sd.generate(p, max_new_tokens=tokens, chat=False).token_ids for p in prompts]
    engine = BatchEngine(model, WrongDraft(refs, model.config.vocab_size), model.config.vocab_size, set(), 256,
                         max_batch_rows=64)
    engine.pass_ms = lambda rows: 10.0 + 2.0 * rows  # (not refined by the tiny model's passes)
    seqs = [engine.add(Sequence(tok(p).input_ids, tokens, SamplingParams())) for p in prompts]
    rows = []  # (requests running, draft rows) a pass
    while engine.running:
        n = len(engine.running)
        rows.append((n, sum(len(rec.proposed) for _, rec in engine.step())))
        for s in engine.running:
            for a in engine._state[s.id][2].alpha:
                a.value, a.n = 0.95, 10
    for ref, s in zip(refs, seqs):
        assert s.generated == ref[len(ref) - tokens:]
    return rows, engine


def test_rows_bought_on_estimates_too_high_are_bought_at_what_was_accepted(rt):
    """8 requests: the split first buys chains on 0.95 a row and none is accepted; once it has seen that at 8
    decoding, it reads the estimates at about the accepted share (the prior decaying, floored at FLOOR: 0.475 a row,
    less than the row costs) and buys no more rows but a probe now and then."""
    rows, engine = run(rt, 8)
    full = [r for n, r in rows if n == 8]
    first = next(i for i, r in enumerate(full) if r)
    assert full[first] >= 8  # before it knows: a chain for every request
    assert sum(r > 1 for r in full) <= 3  # a few passes of chains (PRIOR_TOKENS), then what was accepted counts
    after = [r for r in full[first:] if r <= 1]
    assert len(after) >= 30 and sum(after) <= len(after) // 2  # probes: one a pass at most
    assert engine.hindsight.measured(level(8)) < 0.6 and engine.hindsight.ratio(8) < 0.6  # (the prior, decaying)


def test_a_lone_requests_rows_are_measured_not_corrected(rt):
    """Alone, the same draft and the same wrong estimates: the shortfall is measured at level 1, its rows stay."""
    rows, engine = run(rt, 1)
    assert engine.hindsight.measured(level(1)) < 0.5 and engine.hindsight.ratio(1) == 1.0
    assert sum(r > 1 for _, r in rows) >= len(rows) * 3 // 4


def test_the_optimizers_curse_is_what_it_corrects():
    """8 requests whose drafts are all right 0.8 a row, each estimated by its own running average (policy's Ema):
    one row a pass goes to the highest estimate. Its rows are accepted at ~0.8 but were expected at more, and the
    ratio the split reads says so; each estimate alone is unbiased."""
    rng, hindsight = random.Random(0), Hindsight()
    est = [Ema(0.8, weight=2.0, decay=0.95) for _ in range(8)]
    chosen, picked = [], []
    for _ in range(4000):
        i = max(range(8), key=lambda i: est[i].value)
        chosen.append(est[i].value)
        hit = rng.random() < 0.8
        picked.append(hit)
        hindsight.observe(8, est[i].value, int(hit))
        est[i].update(float(hit))
        for j in range(8):  # the others' drafts are verified too (by probes and their own rows)
            if j != i:
                est[j].update(float(rng.random() < 0.8))
    assert sum(chosen) / len(chosen) > 0.85 > sum(picked) / len(picked) > 0.75
    assert hindsight.ratio(8) < 0.95


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.integers(1, 20), st.floats(0.0, 20.0), st.integers(0, 20)), max_size=40),
       st.lists(st.floats(0.0, 1.0), min_size=1, max_size=6), st.integers(1, 8), st.integers(1, 20))
def test_a_correction_scales_every_reach_by_one_ratio(passes, alphas, rows, decoding):
    """Whatever was observed: a lone request is never corrected, the ratio stays within [FLOOR, 1], and the split
    reads each demand's expected extra tokens at exactly that ratio of the uncorrected (the later α unchanged)."""
    hindsight = Hindsight()
    for n, expected, accepted in passes:
        hindsight.observe(n, expected, accepted)
    assert hindsight.ratio(1) == 1.0 and FLOOR <= hindsight.ratio(decoding) <= 1.0
    d = Demand(alphas, 0.1, 8)
    (scaled,) = hindsight.scaled([d], decoding)
    at = lambda a, k: a[min(k, len(a) - 1)]  # noqa: E731 (costs.expected_tokens reuses the last α)
    assert all(at(scaled.alphas, k) == at(d.alphas, k) for k in range(1, 8))
    assert expected_extra(scaled, rows) == pytest.approx(hindsight.ratio(decoding) * expected_extra(d, rows))


def test_a_scaled_split_buys_no_more_rows():
    """The same demands at a lower ratio never get more rows in all (the split values each row by its reach)."""
    demands = [Demand([0.9, 0.85, 0.8], 0.05, 8) for _ in range(8)]
    pass_ms = lambda rows: 30.0 + 0.8 * rows + (6.0 if rows > 8 else 0.0)  # noqa: E731 (a q8 tile's step past 8)
    totals = []
    for ratio in (1.0, 0.9, 0.7, 0.5):
        hindsight = Hindsight()
        hindsight.expected[False][level(8)], hindsight.accepted[False][level(8)] = 100.0, 100.0 * ratio
        totals.append(sum(plan(hindsight.scaled(demands, 8), 8, 64, pass_ms)))
    assert totals == sorted(totals, reverse=True) and totals[0] > totals[-1]


class RightChainsWrongTrees(WrongDraft):
    """Half the requests get the target's own next tokens as a chain (sized on measured acceptance: accepted
    whole); the others get a wrong token as a one-branch tree the draft values at 0.95 a node (sized on those
    values: never accepted). Model-free: proposed before the split."""
    free = True

    def propose(self, context, k, params, generator):
        ref = next(r for r in self.references if r[:len(context)] == context and len(r) > len(context))
        if self.references.index(ref) % 2 == 0:
            return Draft(ref[len(context):len(context) + k])
        chain = super().propose(context, k, params, generator).tokens
        return Draft(chain, parents=list(range(-1, len(chain) - 1)), values=[0.95 ** (i + 1) for i in range(len(chain))])

    def reset(self):
        pass


def test_rows_sized_on_a_drafts_own_values_are_corrected_apart(rt):
    """8 requests: 4 draft right chains, 4 draft trees valued at 0.95 a node that the target never accepts. The
    trees' values are read at the floor and their nodes are no longer bought, while the chains, whose estimates
    start low, get rows as their acceptance shows. Booked together, the trees' shortfall scaled the chains' estimates
    down, and the right chains never drafted (at 8 streams a feature draft's trees, accepted at 0.29 a node, and
    copies at 0.88 were booked as one)."""
    model, tok = rt
    prompts = [f"abcabc {i} " * 3 for i in range(8)]
    sd = SpecDecoder.from_models(model, tok, draft="none")
    refs = [tok(p).input_ids + sd.generate(p, max_new_tokens=48, chat=False).token_ids for p in prompts]
    engine = BatchEngine(model, RightChainsWrongTrees(refs, model.config.vocab_size), model.config.vocab_size, set(),
                         256, max_batch_rows=64)
    engine.pass_ms = lambda rows: 10.0 + 1.2 * rows  # noqa: E731 (not refined by the tiny model's passes)
    seqs = [engine.add(Sequence(tok(p).input_ids, 48, SamplingParams())) for p in prompts]
    rows = []  # per pass while all 8 run: (the chains' draft rows, the trees' nodes)
    while engine.running:
        out = engine.step()
        if len(engine.running) == 8 and out:
            drafted = [(seqs.index(s) % 2, len(rec.proposed)) for s, rec in out]
            rows.append(tuple(sum(n for odd, n in drafted if odd == k) for k in (0, 1)))
    for ref, s in zip(refs, seqs):
        assert s.generated == ref[len(ref) - 48:]
    first = next(i for i, (_, t) in enumerate(rows) if t)
    assert rows[first][1] >= 8 and sum(t for _, t in rows[first + 2:]) == 0  # two passes of trees, then none
    assert sum(c for c, _ in rows) >= 16  # the chains draft
    assert engine.hindsight.ratio(8, valued=True) < 0.6 and engine.hindsight.ratio(8) == 1.0  # (chains: as they are)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.integers(1, 20), st.floats(0.0, 20.0), st.integers(0, 20), st.booleans()), max_size=40))
def test_one_kinds_correction_never_moves_the_others(passes):
    """Whatever one kind of rows was accepted at, the other kind's ratio is what its own passes alone give."""
    both, alone = Hindsight(), {kind: Hindsight() for kind in (False, True)}
    for n, expected, accepted, valued in passes:
        both.observe(n, expected, accepted, valued)
        alone[valued].observe(n, expected, accepted, valued)
    for kind in (False, True):
        for n in (1, 2, 5, 8):
            assert both.ratio(n, kind) == alone[kind].ratio(n, kind)
    d, v = Demand([0.9], 0.1, 4), Demand([0.9], 0.1, 4, valued=True)
    for n in (2, 5, 8):
        scaled_d, scaled_v = both.scaled([d, v], n)
        assert scaled_d.alphas[0] == pytest.approx(0.9 * both.ratio(n)) and \
            scaled_v.alphas[0] == pytest.approx(0.9 * both.ratio(n, True))


class SlowWrongDraft(WrongDraft):
    """WrongDraft at 40 ms a proposal: dearer than the rows it could save."""

    def propose(self, context, k, params, generator):
        import time
        time.sleep(0.04)
        return super().propose(context, k, params, generator)


def test_a_denied_requests_probe_is_weighed_once_a_period(rt, monkeypatch):
    """8 requests whose drafts are never accepted and cost more than a pass: they are denied rows, and the probe's
    second split (which prices the draft's cost, and declines) is asked only when a denial reaches a multiple of the
    probe period, not every cycle (asked every cycle it cost 0.3 ms of each 60 ms pass at 8 streams)."""
    from specdec.batch import engine as engine_module
    model, tok = rt
    prompts = [f"abcabc {i} " * 3 for i in range(8)]
    sd = SpecDecoder.from_models(model, tok, draft="none")
    refs = [tok(p).input_ids + sd.generate(p, max_new_tokens=64, chat=False).token_ids for p in prompts]
    engine = BatchEngine(model, SlowWrongDraft(refs, model.config.vocab_size), model.config.vocab_size, set(), 256,
                         max_batch_rows=64)
    engine.pass_ms = lambda rows: 10.0 + 2.0 * rows  # noqa: E731
    for p in prompts:
        engine.add(Sequence(tok(p).input_ids, 64, SamplingParams()))
    calls, real = [], engine_module.plan
    monkeypatch.setattr(engine_module, "plan", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    passes = 0
    while engine.running:
        engine.step()
        passes += 1
    every = engine_module.PROBE_EVERY * 2  # (8 decoding: a period per 4 requests)
    assert passes >= 60 and len(calls) - passes <= 8 * passes // every  # the split, and a probe's once a period
