"""benchmarks/suite/pair_streams.py: a throughput claim against target-only is read window by window, with an
interval, not from windows pooled across a drifting machine's moments."""
import math
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent.parent / "benchmarks" / "suite"))
pair_streams = pytest.importorskip("pair_streams")


def windows(*tps):
    return [{"tokens_per_s": x} for x in tps]


def test_drift_that_hits_both_alike_cancels_in_the_paired_ratio():
    # the machine halves its speed between rotations; the draft is 10% faster in each
    base = windows(100.0, 50.0, 80.0)
    out = pair_streams.paired(windows(110.0, 55.0, 88.0), base)
    assert out["ratio"] == pytest.approx(1.1) and out["ci95"] == [1.1, 1.1] and out["rotations"] == 3
    pooled = (110 + 55 + 88) / (100 + 50 + 80)  # (equal walls) the same here, but:
    assert pooled == pytest.approx(1.1)
    # ... a draft run in the slow moments only looks slower pooled, not paired
    out = pair_streams.paired(windows(55.0, 110.0), windows(50.0, 100.0))
    assert out["ratio"] == pytest.approx(1.1)


def test_the_interval_is_students_on_the_log_ratios():
    out = pair_streams.paired(windows(90.0, 110.0), windows(100.0, 100.0))
    logs = [math.log(0.9), math.log(1.1)]
    mean, sd = sum(logs) / 2, abs(logs[1] - logs[0]) / math.sqrt(2)
    half = 12.71 * sd / math.sqrt(2)  # t(0.975, 1 degree of freedom)
    assert out["ratio"] == pytest.approx(math.exp(mean), abs=1e-3)
    assert out["ci95"] == [pytest.approx(math.exp(mean - half), abs=1e-3), pytest.approx(math.exp(mean + half), abs=1e-3)]
    assert out["ci95"][0] < 1 < out["ci95"][1]  # one rotation each way: nothing is claimed


def test_one_rotation_claims_nothing():
    assert pair_streams.paired(windows(120.0), windows(100.0)) is None
    assert pair_streams.paired(windows(0.0, 0.0), windows(100.0, 90.0)) is None  # a window with nothing served


def answer(stream, tokens, pieces, end):
    return {"stream": stream, "tokens": tokens, "timeline": {"start": 0.0, "end": end, "pieces": pieces}}


def test_all_busy_ends_when_the_first_stream_runs_out_and_counts_the_text_that_had_arrived():
    # stream 0: two answers of 10 tokens, done at t=4; stream 1: one answer of 20 tokens, half of its text by t=4
    done = [answer(0, 10, [(1.0, 5), (2.0, 5)], 2.0), answer(0, 10, [(3.0, 4), (4.0, 6)], 4.0),
            answer(1, 20, [(2.0, 30), (4.0, 10), (5.0, 40)], 6.0)]
    tokens, seconds = pair_streams.all_busy(done, 0.0, 2)
    assert seconds == 4.0 and tokens == pytest.approx(10 + 10 + 20 * 40 / 80)
    # the tail (stream 1 alone from 4 to 6 s) is left out: the window's rate would be 40 / 6
    assert tokens / seconds == pytest.approx(7.5) != pytest.approx(40 / 6)


def test_a_draft_that_only_shortens_some_answers_is_not_charged_for_the_tail():
    # target-only: both streams take 4 s for 40 tokens; the draft halves stream 0's time only, and every pass
    # delivered as much or more; over the window (4 s) it looks equal, while both streams were busy it is faster
    base = [answer(c, 40, [(t, 10) for t in (1.0, 2.0, 3.0, 4.0)], 4.0) for c in (0, 1)]
    draft = [answer(0, 40, [(t, 20) for t in (1.0, 2.0)], 2.0),
             answer(1, 40, [(t, 10) for t in (1.0, 2.0, 3.0, 4.0)], 4.0)]
    b, d = pair_streams.all_busy(base, 0.0, 2), pair_streams.all_busy(draft, 0.0, 2)
    assert b[0] / b[1] == pytest.approx(20.0) and d[0] / d[1] == pytest.approx(30.0)


def test_a_stream_without_an_answer_was_never_all_busy():
    assert pair_streams.all_busy([answer(0, 5, [(1.0, 3)], 1.0)], 0.0, 2) == (0.0, 0.0)


def test_the_paired_ratio_reads_either_rate():
    base = [{"tokens_per_s": 100.0, "busy_tokens_per_s": 100.0}] * 2
    mine = [{"tokens_per_s": 95.0, "busy_tokens_per_s": 105.0}] * 2
    assert pair_streams.paired(mine, base)["ratio"] == pytest.approx(0.95)
    assert pair_streams.paired(mine, base, "busy_tokens_per_s")["ratio"] == pytest.approx(1.05)
    assert pair_streams.paired(mine, [{"tokens_per_s": 1.0}] * 2, "busy_tokens_per_s") is None  # (an older window)


def test_the_servers_time_by_load_is_read_from_their_pass_logs(tmp_path, capsys):
    import json
    pair = pytest.importorskip("pair")
    rec = dict(rows=8, prompt_rows=0, decoding=8, draft_rows=0, accepted=0, tree=False, verify_ms=80.0,
               priced_ms=80.0, before_ms=0.0, after_ms=0.0, t=0.0)
    (tmp_path / "ours-none.jsonl").write_text(json.dumps(rec) + "\n" + json.dumps(dict(rec, decoding=1, rows=1,
                                                                                    verify_ms=40.0)) + "\n")
    out = pair.server_loads(str(tmp_path), ["ours-none", "ours-0.5b", "llama"])  # (no log: left out)
    assert list(out) == ["ours-none"] and out["ours-none"]["8+"]["tokens_per_s"] == 100.0
    assert out["ours-none"]["1"] == {"passes": 1, "tokens": 1, "s": 0.04, "tokens_per_s": 25.0, "share": 0.111}
    assert "ours-none: 1: 25.0 (11%)" in capsys.readouterr().out
