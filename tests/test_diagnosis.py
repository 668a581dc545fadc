"""The analyzer on real engine traces: a tiny runtime model whose costs are controlled (a target pass that costs
what a real one does, a drafter that spends time per token, one that is never right, a slow per-cycle hook), each cause
planted in a real generation; the analyzer names it and its cost model predicts the measured speedup."""
import itertools

import pytest

from specdec import SpecDecoder, models
from specdec.analyze import analyze
from specdec.costs import measure_verify_curve
from specdec.drafters.base import Draft

PROMPT = "Hello there, general"


class Clock:
    """The engine's and the verify-curve measurement's clock, injected: it moves only when a planted cost is spent,
    so every timing the analyzer reads is exactly the planted one, at any machine speed (busy-waits measured the
    machine's load too, and failed the prediction bound on a shared CI host)."""
    now = 0.0

    @classmethod
    def perf_counter(cls) -> float:
        return cls.now


def spend(ms: float) -> None:
    Clock.now += ms / 1e3


@pytest.fixture(autouse=True)
def virtual_clock(monkeypatch):
    import specdec.costs
    import specdec.engine
    for module in (specdec.engine, specdec.costs):
        monkeypatch.setattr(module, "perf_counter", Clock.perf_counter)


class Scripted:
    """Proposes the target's own greedy continuation (known in advance): right for the first `right` tokens of a
    block (a number, or a cycle of numbers taken in turn), then wrong; `cost_ms` per proposed token."""
    name = "scripted"

    def __init__(self, reference: list[int], vocab: int, right=1 << 30, cost_ms: float = 0.0):
        self.ref, self.vocab, self.cost_ms = reference, vocab, cost_ms
        self.right = itertools.cycle(right if isinstance(right, (list, tuple)) else [right])

    def propose(self, context, k, params, generator) -> Draft:
        n, out, right = len(context), [], next(self.right)
        for i in range(k):
            t = self.ref[n + i] if n + i < len(self.ref) else 3
            out.append(t if i < right else (t + 1) % self.vocab)
        spend(self.cost_ms * len(out))
        return Draft(out)

    def reset(self) -> None:
        pass


@pytest.fixture(scope="module")
def rt(tiny_dirs):
    return models.load(tiny_dirs["target"], backend="runtime")


def pass_cost(model, monkeypatch, base_ms: float, per_row_ms: float) -> None:
    """A target pass costs base + per_row x rows, as a memory-bound pass that turns compute-bound does."""
    original = model.forward

    def slow(tokens, *a, **kw):
        spend(base_ms + per_row_ms * len(tokens))
        return original(tokens, *a, **kw)
    monkeypatch.setattr(model, "forward", slow)


SCENARIOS = {  # planted cause -> (draft: right tokens per block, ms per token), tau, pass (base, per row), hook ms
    "draft_cost": (dict(cost_ms=12.0), 4, (8.0, 0.1), 0.0),
    "verify_cost": (dict(), 4, (1.0, 6.0), 0.0),
    "low_acceptance": (dict(right=0), 3, (8.0, 0.1), 0.0),
    "overhead": (dict(right=2), 3, (8.0, 0.1), 25.0),
    "tau_too_large": (dict(right=1, cost_ms=0.8), 8, (8.0, 0.6), 0.0),
    "tau_too_small": (dict(), 1, (8.0, 0.1), 0.0),
    # right 3, 2, 2, 1, 1, 0 tokens in turn: acceptance falls by position; a bigger target (a 20 ms step)
    "none": (dict(right=[3, 2, 2, 1, 1, 0]), 3, (20.0, 0.1), 0.0),
}


@pytest.mark.parametrize("cause", list(SCENARIOS))
def test_analyzer_names_the_cause_planted_in_a_real_generation(rt, monkeypatch, cause):
    model, tok = rt
    drafter_kw, tau, (base, per_row), hook_ms = SCENARIOS[cause]
    n = 42
    reference = SpecDecoder.from_models(model, tok, draft="none").generate(PROMPT, max_new_tokens=n + 10,
                                                                          chat=False).token_ids
    prompt_ids = tok(PROMPT).input_ids
    pass_cost(model, monkeypatch, base, per_row)
    sd = SpecDecoder.from_models(model, tok, draft=Scripted(prompt_ids + reference, model.config.vocab_size,
                                                             **drafter_kw), tau=tau)
    stop = None
    if hook_ms:  # a slow per-cycle hook: the stop check runs once per cycle, outside draft and verify
        def stop(ids):
            spend(hook_ms)
            return None
    records = list(sd.engine.run(prompt_ids, n, sd.prepare(PROMPT, chat=False).params, tau, stop))
    assert [t for r in records for t in r.emitted] == reference[:n]  # still the target's own output
    # what `generate --trace` writes beside the records: the target's verify curve, measured apart
    curve = measure_verify_curve(model, model.config.vocab_size, prompt_ids, max(tau + 1, 9), reps=3)
    rep = analyze(records, target_curve=curve)
    assert rep["bottleneck"] == cause, (rep["speedup"], [(f["kind"], f["gain"]) for f in rep["findings"]])
    assert abs(rep["speedup"]["prediction_error"]) < 0.05, rep["speedup"]  # exact costs: only the model errs
