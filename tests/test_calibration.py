"""A stored pass curve is a prior, never a verdict (batch/calibration.py OnlineCurve, BatchEngine.probe): whatever
factor a stored size is wrong by, either way, it is timed once by the running process (in idle time) and priced by
what was timed; passes that carry prompt chunks never reprice the decode curve."""
from __future__ import annotations

import random
import time

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from specdec import models
from specdec.batch import BatchEngine, Sequence
from specdec.batch.calibration import SPIKE, OnlineCurve, PassTimer, background_work, default_budget, run_beside, work_beside
from specdec.drafters.base import NoDrafter
from specdec.sampling import SamplingParams

GRID = [1, 2, 4, 8, 16, 32, 64]


@pytest.fixture(autouse=True)
def no_work_beside():
    """An earlier test's server may still be reading its grammar vocabulary on a thread (calibration.background_work,
    a few seconds): no idle probe is due meanwhile, so these tests start once it is done."""
    deadline = time.monotonic() + 60
    while work_beside() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not work_beside()


def machine(rows: int) -> float:
    """A simulated machine's pass time: flat to 4 rows, then ~0.18 of a pass a row (the 1.5B's curve's shape)."""
    return 50.0 + 1.0 * min(rows, 4) + 9.0 * max(0, rows - 4)


def best_rows(price, alpha: float = 0.8) -> int:
    """The chain the cost model would verify: tokens per pass time, drafted rows r - 1 at acceptance alpha."""
    return max(GRID[:5], key=lambda r: (1 - alpha ** r) / (1 - alpha) / price(r))


@settings(max_examples=60, deadline=None)
@given(factors=st.lists(st.floats(1 / 30, 30), min_size=len(GRID), max_size=len(GRID)),
       idle=st.lists(st.booleans(), min_size=40, max_size=40), seed=st.integers(0, 2**16))
def test_a_stored_curve_wrong_by_any_factor_converges(factors, idle, seed):
    """A random schedule: a server's passes (sized by the priced curve) and idle moments (where it times one
    unconfirmed size), against a curve stored wrong by 1/30..30 at each size. Once it has been idle as often as the
    curve has sizes, every size is priced within the machine's noise and the choice is the one the truth makes;
    the probes cost one pass per size, never more."""
    rnd = random.Random(seed)
    curve = OnlineCurve({n: machine(n) * f for n, f in zip(GRID, factors)}, prior=True)
    probes = 0
    for quiet in idle:
        if quiet and (todo := curve.unconfirmed(max(GRID))):
            curve.observe(todo[0], machine(todo[0]) * rnd.uniform(0.95, 1.05))
            curve.probed.add(todo[0])  # (a quiet idle probe, as Admission.probe marks it)
            probes += 1
        else:
            rows = best_rows(curve)
            curve.observe(rows, machine(rows) * rnd.uniform(0.95, 1.05))
    assert probes <= len(GRID)
    if sum(idle) >= len(GRID):
        assert curve.unconfirmed(max(GRID)) == []
        for n in GRID:
            assert curve(n) == pytest.approx(machine(n), rel=0.1)
        assert best_rows(curve) == best_rows(machine)
        kept = curve.refined()  # what a restart reads: a quiet probe's time as it is, traffic's only ever lowering
        assert all(kept[n] == pytest.approx(curve(n), rel=0.1) for n in curve.probed)  # (within the noise)
        assert all(kept[n] <= curve.raw()[n] * (1 + 1e-9) for n in GRID)  # (pricing may go lower: values())


def test_a_measured_curve_is_no_prior_and_a_guess_is_not_scaled_by_its_neighbours():
    measured = OnlineCurve({1: 50.0, 8: 90.0})
    assert measured.unconfirmed(64) == []
    stored = OnlineCurve({1: 50.0, 2: 1500.0, 8: 1600.0}, prior=True)
    stored.observe(3, 52.0)  # a pass between 2 and 8: it does not scale the guessed 2
    assert stored(2) == 1500.0 and stored.unconfirmed(8) == [1, 2, 8]
    stored.observe(2, 51.0)
    assert stored(2) == 51.0 and stored.unconfirmed(8) == [1, 8]


class SteadyTimer:
    """Runs each probe's passes (slot, KV, warm-up) but reports a quiet machine's time, 1 ms + 0.05 ms a row: the
    tiny model's real times on a shared CI machine once made 16 rows look dear and kept the budget at 8 (a timed
    assertion; timings belong in benchmarks)."""

    def __init__(self, real: PassTimer):
        self.real = real

    def __call__(self, rows: int) -> float | None:
        return None if self.real(rows) is None else 1.0 + 0.05 * rows

    def close(self) -> None:
        self.real.close()


@pytest.fixture(scope="module")
def rt(tiny_dirs):
    return models.load(tiny_dirs["target"], backend="runtime")


def test_the_engine_times_what_the_stored_curve_guessed_and_reads_its_budget_again(rt):
    """The issue's curve (every pass of 2+ rows at ~30x one row) set the row budget to one row: no drafting and no
    batching, for good. Probed in idle time, each size is timed once and the budget read off the timed curve."""
    model, tok = rt
    bad = {1: 5.0, **{n: 150.0 for n in GRID[1:]}}
    engine = BatchEngine(model, NoDrafter(), model.config.vocab_size, set(), 256, max_batch_rows=default_budget(bad),
                         pass_curve=bad, curve_is_prior=True)
    engine.budget_from_curve = True
    assert engine.max_batch_rows == 8 and engine.probe_due()  # (never below MIN_BUDGET: once, it was one row)
    engine._timer = SteadyTimer(PassTimer(model))  # real passes on a real slot, priced as a quiet machine would
    probes = 0
    while engine.probe_due() or engine._pass.unconfirmed(max(GRID)):  # (a probe dropped at a busy moment of this
        engine._probe_after = 0.0  # shared machine backs off: time passes here at once)
        engine.probe()
        probes += 1
    assert len(GRID) <= probes <= 3 * len(GRID) and engine.max_batch_rows > 8
    assert all(engine.pass_ms(n) < 150.0 for n in GRID[1:])
    assert model.pool.available == model.pool.blocks  # the probes' slot is given back
    # /metrics shows the curve it started from beside what it prices now, and flags the difference
    from prometheus_client import generate_latest

    from specdec.server.metrics import Metrics
    metrics = Metrics()
    metrics.observe_engine(engine)
    text = generate_latest(metrics.registry).decode()
    assert 'specdec_pass_start_ms{rows="2"} 150.0' in text and "specdec_pass_curve_stale 0.0" in text  # timed once
    for _ in range(3):  # three 2-row passes as a server times them
        engine._pass.observe(2, engine.pass_ms(1))
    metrics.observe_engine(engine)
    text = generate_latest(metrics.registry).decode()
    priced = float(text.split('specdec_pass_priced_ms{rows="2"} ')[1].split()[0])
    assert priced < 75.0 and 'specdec_pass_timed{rows="2"} 4.0' in text and "specdec_pass_curve_stale 1.0" in text


def test_a_pass_with_prompt_chunks_does_not_reprice_the_curve(rt):
    """A server's own load: passes carrying prompt chunks are booked under nothing (they once priced 2..32 rows at
    8x one row); decode passes refine the curve."""
    model, tok = rt
    engine = BatchEngine(model, NoDrafter(), model.config.vocab_size, set(), 256, max_batch_rows=16, prefill_chunk=8,
                         pass_curve={n: 1.0 for n in GRID})
    seen = []
    engine._pass.observe = lambda rows, ms: seen.append(rows)
    seq = engine.add(Sequence(tok("a prompt of several chunks, " * 3).input_ids, 4, SamplingParams()))
    chunks = 0
    while engine.running:
        prefilling = seq.prefilling
        engine.step()
        assert not engine.failed
        chunks += prefilling
    assert chunks >= 2 and len(seen) == 4 - 1  # the decode passes only (the last chunk emits the first token)
    # read from the store (a prior), no row count has run in this process: the first pass of each is a cold one,
    # left out
    engine = BatchEngine(model, NoDrafter(), model.config.vocab_size, set(), 256, max_batch_rows=16, prefill_chunk=8,
                         pass_curve={n: 1.0 for n in GRID}, curve_is_prior=True)
    seen.clear()
    engine._pass.observe = lambda rows, ms: seen.append(rows)
    engine.add(Sequence(tok("a prompt of several chunks, " * 3).input_ids, 4, SamplingParams()))
    while engine.running:
        engine.step()
    assert seen == [1, 1]  # three one-row decode passes, the first cold


def test_passes_beside_the_processs_own_background_work_price_nothing(rt):
    """The server reads the vocabulary for structured outputs on a thread right after it says it is ready: passes
    timed meanwhile shared the cores (two such priced 8 rows at 50 ms for a server's life, where quiet ones take 29),
    so they refine nothing, and no idle probe runs; after it, passes refine the curve again."""
    model, tok = rt
    engine = BatchEngine(model, NoDrafter(), model.config.vocab_size, set(), 256, max_batch_rows=16,
                         pass_curve={1: 5.0, **{n: 150.0 for n in GRID[1:]}}, curve_is_prior=True)
    seen = []
    engine._pass.observe = lambda rows, ms: seen.append(rows)

    def run():
        engine.add(Sequence(tok("a prompt").input_ids, 4, SamplingParams()))
        while engine.running:
            engine.step()
            assert not engine.failed

    run()  # (the first one-row pass in a process is a cold one, never timed)
    seen.clear()
    assert engine.probe_due()
    with background_work():
        assert work_beside() and not engine.probe_due()
        run()
    assert seen == [] and not work_beside() and engine.probe_due()
    run()
    assert seen and set(seen) == {1}
    # a thread started as such work counts from its start, and until it ends
    import threading
    go = threading.Event()
    thread = run_beside(go.wait)
    assert work_beside() and not engine.probe_due()
    go.set()
    thread.join()
    assert not work_beside() and engine.probe_due()


def test_a_disturbed_measurement_is_retaken_then_used_for_this_run_only(rt, tmp_path, monkeypatch, capsys):
    """Repetitions that spread widely, or a size slower than a larger one, say the machine was busy: measured
    again, and if still so, used for this run only (the next start measures again), with one stderr line."""
    from specdec.batch import calibration
    assert calibration.disturbance({1: [5.0, 5.1, 5.2], 2: [5.2, 5.3, 5.2]}) is None
    assert "took 5.0 to 80.0" in calibration.disturbance({1: [5.0, 80.0, 79.0], 2: [5.2, 5.3, 5.2]})
    assert calibration.disturbance({1: [16.2, 25.2, 16.4], 2: [16.5, 16.6, 16.5]}) is None  # one hiccup of three
    assert "rows took" in calibration.disturbance({1: [50.0] * 3, 2: [5.0] * 3})
    # a one-row q8 pass far slower than reading its weights at the bandwidth measured beside it
    assert "20x the 2.0 ms" in calibration.disturbance({1: [40.0] * 3, 2: [41.0] * 3}, read_ms=2.0)
    assert calibration.disturbance({1: [10.0] * 3}, read_ms=2.0) is None  # 5x: a q8 pass reads at 40-70%
    assert calibration.disturbance({1: [40.0] * 3}, read_ms=0.1) is None  # a tiny model: its pass is overhead
    calls, answers = [], []

    def busy(model, sizes, context, reps, step=None):
        calls.append(1)
        return answers.pop(0) if answers else ({n: 10.0 * n for n in sizes}, "1 rows took 5.0 to 80.0 ms")
    monkeypatch.setattr(calibration, "_measure", busy)
    with pytest.raises(calibration.Disturbed) as e:
        calibration.measure_pass_curve(rt[0], (1, 2), check=True)
    assert len(calls) == 2 and e.value.curve == {1: 10.0, 2: 20.0}
    assert calibration.measure_pass_curve(rt[0], (1, 2)) == {1: 10.0, 2: 20.0}  # unchecked: as measured
    # an inversion alone, taken again, is the kernels' (a one-row pass of the 1.5B took 35 ms, two rows 22 ms, on an
    # EPYC, every time): kept and stored; a spread taken again is a busy machine's
    inverted = calibration.INVERSION + "1 rows took 35.0 ms, 2 rows 22.0 ms"
    answers[:] = [({1: 22.0, 2: 22.0}, "2 rows took 23.0 to 42.2 ms"), ({1: 22.5, 2: 22.4}, inverted)]
    assert calibration.measure_pass_curve(rt[0], (1, 2), check=True) == {1: 22.5, 2: 22.4}
    answers[:] = [({1: 22.0, 2: 22.0}, inverted), ({1: 90.0, 2: 90.0}, "2 rows took 23.0 to 42.2 ms")]
    with pytest.raises(calibration.Disturbed):
        calibration.measure_pass_curve(rt[0], (1, 2), check=True)


@pytest.mark.real
def test_calibrate_shows_the_stored_curve_beside_a_fresh_one_and_replaces_it(tmp_path, monkeypatch, capsys):
    """`specdec calibrate` on the default model: nothing stored at first; --store stores the measurement; the
    next call shows it as stored. A directory target and a missing file are one line, exit 2."""
    import json

    from specdec.batch import calibration
    from specdec.cli import main
    from specdec.runtime import measured
    where = measured._where  # measurements kept in tmp_path (the kernels and q8 layouts stay in the usual cache)
    monkeypatch.setattr(measured, "_where", lambda m, w, p: (where(m, w, p)[0], tmp_path / where(m, w, p)[1].name))
    fresh = iter(range(1, 100))  # each measurement its own numbers (timing itself: test_batch's measure test)
    monkeypatch.setattr(calibration, "_measure", lambda model, sizes, context, reps, step=None: (
        {n: float(next(fresh)) + n for n in sizes}, None))
    assert main(["calibrate", "--json"]) == 0
    first = json.loads(capsys.readouterr().out)
    assert first["stored"] is None and sorted(first["fresh"], key=int) == [str(n) for n in calibration.server_curve(
        8192)[0]] and "9" in first["fresh"]  # (a row past a full q8 tile: a step of its own)
    assert main(["calibrate", "--json", "--store"]) == 0
    stored = json.loads(capsys.readouterr().out)["fresh"]
    assert main(["calibrate", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["stored"] == stored
    assert main(["calibrate"]) == 0 and "stored / now" in capsys.readouterr().out
    assert main(["calibrate", "--plot", str(tmp_path / "c.png")]) == 0 and (tmp_path / "c.png").stat().st_size > 1000
    assert main(["calibrate", "--plot", str(tmp_path / "no" / "c.png")]) == 2  # one line, not a traceback
    capsys.readouterr()
    for bad in (str(tmp_path), str(tmp_path / "missing.gguf")):
        assert main(["calibrate", "--target", bad]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and err.startswith("specdec: error:")


def test_no_pass_is_priced_or_believed_above_its_rows_in_one_row_passes():
    """A pass of n rows could run its rows one at a time: a stored guess above ROWS_SLACK·n one-row passes is capped
    there once a one-row pass is timed, and a time above it (a neighbour had the cores) is left out, not stored."""
    from specdec.batch import calibration
    curve = OnlineCurve({1: 20.0, 2: 600.0, 4: 600.0, 8: 600.0}, prior=True)  # 2+ rows at 30x one row
    assert curve(2) == 600.0  # nothing timed yet: the guess
    curve.observe(1, 20.0)
    cap = calibration.ROWS_SLACK * 20.0
    assert curve(2) <= 2 * cap + calibration.NOISE_MS and curve(8) <= 8 * cap + calibration.NOISE_MS
    curve.observe(4, 450.0)  # timed beside another server's load
    assert curve.implausible == 1 and 4 not in curve.confirmed
    curve.observe(2, 22.0)
    curve.observe(4, 25.0)
    assert curve(4) == 25.0 and curve.refined()[8] <= 8 * cap + calibration.NOISE_MS


def test_a_size_no_pass_timed_for_a_while_is_timed_again():
    """A probe taken while a neighbour had the cores priced 2 rows out, and no 2-row pass ever ran to correct it:
    a size no pass timed for REPROBE_S is due again (in idle time), whatever it was timed at."""
    from time import monotonic

    from specdec.batch import calibration
    curve = OnlineCurve({1: 20.0, 2: 25.0, 4: 30.0})
    now = monotonic()
    assert curve.due(64, now) == []  # measured here, just now
    later = now + calibration.REPROBE_S + 1
    assert curve.next_due(64, now) == pytest.approx(calibration.REPROBE_S, abs=1.0)  # (an idle worker's sleep)
    curve.timed_at[1] = later  # one-row passes run all the time
    assert curve.due(64, later) == [2, 4] and curve.due(2, later) == [2] and curve.next_due(64, later) == 0.0
    curve.observe(2, 80.0)  # a busy moment, within ROWS_SLACK: believed, for now, and timed again later
    curve.timed_at[2] = later
    assert curve.due(64, later) == [4]


def test_a_probe_beside_a_slow_one_row_pass_is_a_busy_moment_and_dropped(rt, monkeypatch):
    """A probe also times a one-row pass beside it: where that took BUSY times the one-row price, the machine was
    busy (a neighbour's request), and the probe is dropped and tried again after a back-off."""
    from specdec.batch import admission
    model, _ = rt
    engine = BatchEngine(model, NoDrafter(), model.config.vocab_size, set(), 256, max_batch_rows=8,
                         pass_curve={1: 10.0, 2: 300.0}, curve_is_prior=True)
    engine._pass.observe(1, 10.0)
    one_row = [30.0]
    class Timer:
        def __init__(self, model):
            pass

        def __call__(self, rows):
            return one_row[0] if rows == 1 else 12.0

        def close(self):
            pass
    monkeypatch.setattr(admission, "PassTimer", Timer)
    assert engine.probe_due()
    engine.probe()
    assert 2 not in engine._pass.confirmed and not engine.probe_due()  # dropped, backing off
    assert 0.0 < engine.probe_wait() <= admission.PROBE_BACKOFF_S  # (how long an idle worker sleeps before it)
    engine._probe_after = 0.0
    one_row[0] = 10.0
    engine.probe()
    assert 2 in engine._pass.confirmed and engine.pass_ms(2) == 12.0


@pytest.mark.parametrize("one_row_ms", [11.0, 200.0])
def test_a_slow_one_row_probe_is_believed_only_the_third_time_in_a_row(rt, monkeypatch, one_row_ms):
    """Nothing beside a one-row probe says whether the machine was quiet: timed above BUSY x the stored one-row price
    (a fresh server's first probe beside a second server starting: 813 ms where 49 was stored, and every size up to 9
    rows priced alike), it is dropped and tried again after a back-off, and believed on the third try in a row (a
    machine that really is slower). A quiet time is believed at once."""
    from specdec.batch import admission
    model, _ = rt
    engine = BatchEngine(model, NoDrafter(), model.config.vocab_size, set(), 256, max_batch_rows=8,
                         pass_curve={1: 10.0, 2: 12.0}, curve_is_prior=True)

    class Timer:
        def __init__(self, model):
            pass

        def __call__(self, rows):
            return one_row_ms if rows == 1 else 12.0

        def close(self):
            pass
    monkeypatch.setattr(admission, "PassTimer", Timer)
    tries = 0
    while 1 not in engine._pass.confirmed:
        assert engine.probe_due()
        engine.probe()
        tries += 1
        engine._probe_after = 0.0  # (the back-off's time passes here at once)
    assert tries == (1 if one_row_ms < 20 else admission.SLOW_ONE_TRIES)
    assert engine.pass_ms(1) == one_row_ms


def test_a_size_priced_out_is_bought_in_traffic_at_one_pass_in_fifty(rt):
    """A stored curve prices 4+ rows far above the truth and no idle moment comes to time them: once in
    SIZE_PROBE_EVERY passes the drafts on hand are given floors up to the smallest such size, so traffic times it
    (the first pass of a row count is a cold one: the second is booked), and the output is the target's alone."""
    from specdec.api import build_drafter
    from specdec.batch.engine import SIZE_PROBE_EVERY
    model, tok = rt
    bad = {1: 1.0, 2: 1.1, **{n: 30.0 * n for n in GRID[2:]}}
    engine = BatchEngine(model, build_drafter("target", model, tok, backend="runtime"), model.config.vocab_size,
                         set(), 256, max_batch_rows=16, pass_curve=bad, curve_is_prior=True)
    engine._pass.observe(1, 1.0)  # (the tiny model's real times would move the one-row price: fixed here)
    engine._pass.confirmed.update({1, 2})
    engine._pass.observe = lambda rows, ms, seen=engine._pass.observe: seen(rows, min(ms, bad[2]))
    prompt = tok("abcabcabcabc").input_ids
    seq = engine.add(Sequence(prompt, 6 * SIZE_PROBE_EVERY, SamplingParams()))
    rows = []
    while engine.running:
        engine.step()
        rows.append(engine.last.get("rows", 0))
    assert 4 in engine._pass.confirmed and engine.pass_ms(4) < 30.0  # bought, timed, priced by its time
    bought = [i for i, r in enumerate(rows) if r > 2]  # the prompt's pass, then one pass in SIZE_PROBE_EVERY
    assert bought[:3] == [0, SIZE_PROBE_EVERY, 2 * SIZE_PROBE_EVERY]  # until its time prices it: then it pays
    sd_alone = BatchEngine(model, NoDrafter(), model.config.vocab_size, set(), 256, max_batch_rows=16)
    ref = sd_alone.add(Sequence(prompt, 6 * SIZE_PROBE_EVERY, SamplingParams()))
    while sd_alone.running:
        sd_alone.step()
    assert seq.generated == ref.generated


def test_traffic_buys_no_size_past_twice_its_rows_or_8_more(rt, monkeypatch):
    """Three requests decode (3 rows a pass) under a stored curve that prices 4+ rows out: traffic buys 4 and 8 rows,
    never 16 (more than 3 + 8): a pass that dear is left to idle time (a 32-row pass bought every 50 at 8 streams
    was 5% of the server's time)."""
    from specdec.api import build_drafter
    from specdec.batch import engine as engine_module
    monkeypatch.setattr(engine_module, "SIZE_PROBE_EVERY", 20)  # (4, 4, 8, 8, then 16 is due: 200 tokens)
    model, tok = rt
    bad = {1: 1.0, 2: 1.1, **{n: 30.0 * n for n in GRID[2:]}}
    engine = BatchEngine(model, build_drafter("target", model, tok, backend="runtime"), model.config.vocab_size,
                         set(), 256, max_batch_rows=32, pass_curve=bad, curve_is_prior=True)
    engine._pass.observe(1, 1.0)
    engine._pass.confirmed.update({1, 2})
    engine._pass.observe = lambda rows, ms, seen=engine._pass.observe: seen(rows, min(ms, bad[2]))  # (tiny: fixed)
    prompt = tok("abcabcabcabc").input_ids
    for _ in range(3):
        engine.add(Sequence(prompt, 200, SamplingParams()))
    rows = []
    while engine.running:
        engine.step()
        rows.append(engine.last.get("rows", 0))
    assert {4, 8} <= engine._pass.confirmed and 16 not in engine._pass.confirmed  # the sizes due up to 3 + 8 rows
    assert max(rows[1:]) <= 11


def test_no_size_is_priced_above_a_larger_size_timed_here():
    """A time can only be too high (noise adds time): a one-row probe taken while 8 clients' requests were parsed
    (55 ms) priced 1-16 rows alike, where 8-row passes took 30 ms. Each size is priced at most any larger size
    timed here; what is stored keeps each size's own time (refined: traffic only lowers it)."""
    curve = OnlineCurve({1: 19.0, 2: 20.0, 4: 21.0, 8: 30.0, 16: 57.0}, prior=True)
    curve.observe(1, 55.0)  # the busy one-row probe: replaces the guess
    assert curve(1) == 55.0 and curve(8) == 55.0  # nothing larger timed yet: flat, as before
    for _ in range(3):
        curve.observe(8, 30.0)
    assert curve(1) == 30.0 and curve(4) == 30.0 and curve(8) == 30.0 and curve(16) == 57.0
    assert curve.raw()[1] == 55.0 and curve.refined()[1] == 19.0  # its own time; stored: traffic only lowers it
    first = OnlineCurve({1: 16.4, 2: 16.4, 4: 18.8, 8: 31.5}, prior=True)  # a model draft's server: its few one-row
    for rows, ms in [(1, 32.0)] * 9 + [(2, 18.1)] * 19 + [(4, 19.1)] * 40:  # passes are requests' first (fresh KV)
        first.observe(rows, ms)
    assert first(1) <= 18.1 and first.refined()[1] <= 18.1 and first.refined()[8] == 31.5  # stored as priced


def test_an_idle_server_times_its_stored_curve_once_its_background_work_ends(rt, monkeypatch):
    """A server that starts beside its own background work (the grammar vocabulary's read) may not probe then; once
    the work ends it probes with no request to wake it, and again once a size falls due (REPROBE_S), as /metrics
    says. (Its worker slept until the first request: a Qwen2.5-1.5B server served 8 streams on a stored curve
    pricing 9-16 rows at 1.3-1.6x their time, so never bought them.)"""
    from prometheus_client import generate_latest

    from specdec.batch import calibration
    import threading

    from specdec import SpecDecoder
    from specdec.server.metrics import Metrics
    from specdec.server.worker import BatchWorker
    model, tok = rt
    bad = {1: 5.0, **{n: 150.0 for n in GRID[1:]}}
    engine = BatchEngine(model, NoDrafter(), model.config.vocab_size, set(), 256, max_batch_rows=default_budget(bad),
                         pass_curve=bad, curve_is_prior=True)
    engine.budget_from_curve = True
    engine._timer = SteadyTimer(PassTimer(model))
    monkeypatch.setattr(calibration, "REPROBE_S", 4.0)  # (5 minutes, shortened)
    go = threading.Event()
    thread = run_beside(go.wait)
    worker = BatchWorker(SpecDecoder.from_models(model, tok, draft="none"), Metrics(), 8, 60.0, None,
                         lambda decoder: engine)
    try:
        worker.wait_ready()
        time.sleep(1.5)  # (past PROBE_QUIET_S: it would have probed by now, were it not for the work beside)
        assert engine._pass.unconfirmed(max(GRID)) == GRID  # nothing timed beside the work
        go.set()
        thread.join()
        deadline = time.monotonic() + 30
        while engine._pass.unconfirmed(max(GRID)) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert engine._pass.unconfirmed(max(GRID)) == [] and engine.max_batch_rows > 8  # no request came
        text = generate_latest(worker.metrics.registry).decode()
        assert "specdec_pass_probes_pending 0.0" in text
        first = engine._pass.timed_at[max(GRID)]
        engine._timer = SteadyTimer(PassTimer(model))
        deadline = time.monotonic() + 30
        while engine._pass.timed_at[max(GRID)] == first and time.monotonic() < deadline:
            time.sleep(0.05)
        assert engine._pass.timed_at[max(GRID)] > first  # woken to time it again, no request coming
    finally:
        go.set()
        worker.stop()


def test_one_slow_pass_moves_a_price_a_bounded_step_and_a_lasting_change_still_moves_it():
    """A pass timed at 2.5x its price (a neighbour's busy moment, still plausible) raises that size's price by a
    bounded step (calibration.SPIKE), so the split still buys the rows it bought; 20 passes at 1.5x are learnt; a
    quiet idle probe's time is believed as it is."""
    curve = OnlineCurve({n: machine(n) for n in GRID})
    chosen = best_rows(curve)
    assert chosen == best_rows(machine) == 4
    curve.observe(chosen, 2.5 * machine(chosen))
    assert curve(chosen) <= SPIKE * machine(chosen) and best_rows(curve) == chosen
    slower = OnlineCurve({n: machine(n) for n in GRID})
    for _ in range(20):
        slower.observe(4, 1.5 * machine(4))
    assert slower(4) >= 1.4 * machine(4)
    probed = OnlineCurve({n: machine(n) for n in GRID})
    probed.observe(4, 1.5 * machine(4), quiet=True)
    assert probed(4) == pytest.approx(machine(4) * (1 + 0.5 / 2.8))  # (the Ema's first step: weight 2.8)


def test_a_one_row_price_busy_three_probes_in_a_row_is_stale_and_replaced(rt, monkeypatch):
    """A probe is dropped where the one-row pass before it took BUSY x the one-row price (a neighbour's moment), and
    retried after a back-off of at most PROBE_BACKOFF_S, less up to half at random. The third such verdict in a row
    means the price is stale (the machine slower than when it was timed): the one-row time replaces it and the
    probe runs. Judged against a stale price, idle servers never probed again, and three of them sharing a machine
    took each other for busy neighbours. A price judged against such a time is this run's only: what is stored for
    the next start only ever lowers (a server beside busy neighbours stored 64 rows at 762 ms where 406 was quiet)."""
    from specdec.batch import admission
    model, _ = rt
    engine = BatchEngine(model, NoDrafter(), model.config.vocab_size, set(), 256, max_batch_rows=8,
                         pass_curve={1: 10.0, 2: 12.0}, curve_is_prior=True)
    engine._pass.observe(1, 10.0)

    class Timer:
        def __init__(self, model):
            pass

        def __call__(self, rows):
            return 30.0 if rows == 1 else 36.0

        def close(self):
            pass
    monkeypatch.setattr(admission, "PassTimer", Timer)
    waits = []
    for _ in range(admission.SLOW_ONE_TRIES - 1):
        engine.probe()
        assert 2 not in engine._pass.confirmed
        waits.append(engine.probe_wait())
        engine._probe_after = 0.0  # (the back-off's time passes here at once)
    assert all(admission.PROBE_BACKOFF_S / 2 - 0.1 <= w <= admission.PROBE_BACKOFF_S for w in waits)
    engine.probe()
    assert engine.pass_ms(1) == 30.0 and 2 in engine._pass.confirmed and engine.pass_ms(2) == 36.0
    assert engine.refined_pass_curve() == {1: 10.0, 2: 12.0}
