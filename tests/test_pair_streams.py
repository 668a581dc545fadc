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
