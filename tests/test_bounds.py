"""benchmarks/pair.py bounds: the cheapest cut of an answer into passes, on toy curves where the answer is known."""
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent.parent / "benchmarks" / "suite"))
bounds = pytest.importorskip("bounds")

FLAT = {r: 1.0 for r in range(1, 17)}  # every pass costs one row's time
LINEAR = {r: 1.0 + 0.5 * (r - 1) for r in range(1, 17)}


def test_an_oracle_on_a_flat_curve_takes_sixteen_tokens_a_pass():
    assert bounds.cheapest(40, [16] * 40, FLAT) == 3  # 16 + 16 + 8
    assert bounds.cheapest(5, [0] * 5, FLAT) == 5  # nothing drafted: one token a pass


def test_a_copy_drafts_only_its_run_and_a_model_fills_the_rest_at_its_price():
    copy = [3, 2, 1, 0, 0, 0]
    assert bounds.cheapest(6, copy, FLAT) == 3  # 3 copied + its own token in one pass, then one a pass
    assert bounds.cheapest(6, copy, FLAT, token_cost=0.25) == pytest.approx(1.5)  # one pass, two model drafts
    assert bounds.cheapest(6, [0] * 6, LINEAR, plain=0.5) == pytest.approx(3.0)  # a cheaper token, every token


def test_copy_runs_count_only_stretches_a_drafter_could_find():
    source = [1, 2, 3, 4, 9, 9]
    assert bounds.copy_runs([1, 2, 3, 4, 5, 1, 2], source) == [4, 3, 0, 0, 0, 0, 0]  # under MIN_RUN: 0


def test_a_model_rate_matches_its_best_chain():
    rate = bounds.model_rate(1.0, 0.0, LINEAR)  # always right, free: 16 tokens for 8.5 passes
    assert rate == pytest.approx(8.5 / 16)
    assert bounds.model_rate(0.0, 0.1, LINEAR) == 1.0  # never right: no drafts


def test_the_per_token_alpha_reproduces_a_measured_run():
    a = 0.8  # chains of 3: 0.8 + 0.64 + 0.512 accepted of 3 proposed (acceptance 0.651), 2.952 tokens a pass
    accepted = a + a ** 2 + a ** 3
    assert bounds.per_token_alpha(accepted / 3, 1 + accepted) == pytest.approx(a, abs=1e-3)
    assert bounds.per_token_alpha(0.0, 1.0) == 0.0
