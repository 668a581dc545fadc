"""`specdec analyze TRACE.jsonl|DIR ...`: why was this run fast or slow?

Reads per-cycle records (from `generate --trace` or the server's --trace-dir) and reports acceptance by position,
the time split, the measured speedup against the cost model's prediction, and what each cause costs: for each, the
speedup if it were removed (`speedup_if_fixed`):
- draft_cost: drafting free;
- verify_cost: a pass over n rows costing one target step;
- overhead: no time outside drafting and verifying;
- rare_proposals: the drafter proposing in every cycle it was asked, as well as it does when it proposes (a cycle
  with nothing proposed is "no match", not a τ choice: records say what was asked, what was drafted and why fewer
  were verified, trace.SHORTFALLS);
- tau_too_large / tau_too_small: the best τ for the measured acceptance by position (cost model); a longer τ is
  credited only to proposals that τ cut (they filled it), never to cycles that proposed nothing;
and the ceiling, tokens per target pass (drafting free, every pass one step). When even the ceiling is low, the
drafts are rarely offered (`rare_proposals`, if proposing in every cycle would pay) or rarely right
(`low_acceptance`), whatever else costs time. Before either is blamed, the curve the policy priced with (a server
trace's meta) is compared with the passes the trace measured: prices STALE times off, or an n-row pass priced above
1 + ROW_MAX·(n − 1) one-row passes (no machine costs that), are `stale_costs` where the budget cut the drafts
(STALE_CUT of the cycles): the policy's prices, not the draft, kept it from speculating. Cycles of requests whose
model draft's catch-up on the prompt was put off (PUT_OFF_CUT of them) are `put_off`: the draft never ran there.
Otherwise the bottleneck is the cause with the largest gain, or `none` when no cause would add more than
NONE_MARGIN. When the cost model misses the measured speedup by more than
EXPLAIN_MARGIN, the report names the cycles it cannot explain.

Measured and predicted speedups are over the decode cycles (cycle 0 also carries the prompt's prefill) against
one target step, T_verify(1), the cost of a target-only token.
"""
from __future__ import annotations

import json
from collections import Counter
from pathlib import Path
from statistics import mean, median

from .costs import blocks_at, expected_tokens, interpolate, non_decreasing, predicted_speedup, verify_curve
from .errors import SpecDecError
from .trace import CycleRecord, acceptance_by_position, asked_of, read_trace, step_curve, tree_stats

BOTTLENECKS = ("stale_costs", "low_acceptance", "rare_proposals", "draft_cost", "verify_cost", "overhead",
               "tau_too_large", "tau_too_small", "none")
STALE = 2.0  # priced and measured pass times this far apart (either way): the policy priced with a wrong curve
ROW_MAX = 0.5  # ... or each added row priced above this share of a one-row pass (8 rows cost 1.3-2.5x one row on every
# CPU measured: 0.04-0.21 a row; a server caps a stored guess at 1.5 per row, which this still names)
STALE_CUT = 0.1  # either one the cause only where the budget cut what was asked in at least this share of the
# cycles (a request with a fixed τ drafts whatever the prices say: a wrong curve did not shape its run)
PUT_OFF_CUT = 0.25  # cycles whose request's model draft was put off (trace.SHORTFALLS), from which that is the cause
MAX_TAU = 16
LOW_CEILING = 1.15  # tokens per target pass below this: speculation cannot pay, whatever else is fixed
NONE_MARGIN = 0.10  # no cause worth more than +10%: healthy
EXPLAIN_MARGIN = 0.10  # the cost model within 10% of the measured speedup, or the cycles it misses are named
TIME_EXPLAINED = 0.02  # cycles within 2% of their predicted time in all: the cost model's miss is in the tokens

ADVICE = {
    "stale_costs": "the pass curve the policy priced with is not this machine's now (a calibration taken while the "
                   "machine was busy, or another machine's): restart the server, which times each stored size in "
                   "idle time, or start it with SPECDEC_REMEASURE=1 to measure the curve again",
    "put_off": "a model draft's catch-up on each new prompt is weighed against what drafting saves at the load then: "
               "check the pass curve the server priced (a steep one makes drafting look dear; `specdec calibrate`), "
               "or chain a model-free drafter in front (ngram+DRAFT.gguf), which needs no catch-up",
    "low_acceptance": "use a draft closer to the target (distil it on the target's outputs: specdec distill), check "
                      "that the prompt format (chat template) matches, or stop speculating (--draft none)",
    "rare_proposals": "chain a drafter that proposes when this one finds no match (--draft A+B: A first, B when A "
                      "proposes nothing, e.g. ngram+DRAFT.gguf), or use one that always proposes (a draft model, "
                      "specdec distill)",
    "draft_cost": "use a cheaper draft (fewer layers, a reduced-vocabulary head) or a model-free one (ngram, "
                  "datastore); speculation pays only when acceptance clearly exceeds the draft/target cost ratio",
    "verify_cost": "verify fewer tokens per pass (a smaller tau), or run a backend whose multi-token pass costs "
                   "little more than one token (specdec's runtime, a GPU)",
    "verify_cost_at_best_tau": "a smaller tau does not help (the measured acceptance favours tau={best_tau}): what "
                               "a pass's added rows cost is the machine's (the verify curve above); a CPU whose "
                               "kernels add rows for less (AMX, more cores) or a GPU verifies as much for less",
    "overhead": "profile the loop: tokenizer decoding, stop-string checks, logging or I/O inside the cycle; move "
                "them out of the hot path",
    "tau_too_large": "run with the suggested --tau, or --policy adaptive to choose it per cycle",
    "tau_too_small": "run with the suggested --tau, or --policy adaptive to choose it per cycle",
}


MIN_GROUP = 5  # cycles with one proposal length needed for their own acceptance by position
ONE_TIME_FACTOR = 1.5  # a cycle costing this many times the median of its proposal length carries one-time work


def one_time_costs(cycles: list[CycleRecord]) -> dict[int, float]:
    """Cycles that cost far more than the others of their proposal length -> their excess ms: work done once (a
    draft model catching up on the prompt, first touches of fresh KV pages, lazy initialisation), not per cycle.
    Judged only where at least 3 cycles share a proposal length (the median is then a cycle's real cost)."""
    groups: dict[int, list[int]] = {}
    for i, r in enumerate(cycles):
        groups.setdefault(len(r.proposed), []).append(i)
    excess = {}
    for idx in groups.values():
        if len(idx) >= 3:
            mid = median(cycles[i].cycle_ms for i in idx)
            excess.update({i: cycles[i].cycle_ms - mid for i in idx if cycles[i].cycle_ms > ONE_TIME_FACTOR * mid})
    return excess


def _filled(by_pos: list) -> list[float]:
    """A position never reached after an accepted one: assume no better than the one before."""
    out = []
    for a in by_pos:
        out.append(a if a is not None else (out[-1] if out else 0.0))
    return out


def _decode(records: list[CycleRecord]) -> list[CycleRecord]:
    return records[1:] if len(records) > 1 else records  # cycle 0 carries the prompt's prefill


def _fit_draft(records: list[CycleRecord]) -> tuple[float, float]:
    """Draft ms per cycle = a + b·(tokens proposed), least squares with a, b >= 0 over the cycles that asked for a
    draft, less a model draft's catch-up on the prompt (draft_prefill_ms: paid once). A short trace whose proposal
    lengths barely differ gives a wild unconstrained slope (6 cycles of 6 tokens and one of 5 fitted 76 ms a token
    and a negative intercept, against 45 ms a token measured): when a bound binds, the fit is redone on the other
    parameter alone (through the origin, or flat)."""
    pts = [(len(r.proposed), r.draft_ms - r.draft_prefill_ms) for r in records if asked_of(r) > 0]
    if not pts:
        return 0.0, 0.0
    mx, my = mean(x for x, _ in pts), mean(y for _, y in pts)
    var = sum((x - mx) ** 2 for x, _ in pts)
    if var == 0:  # one proposal length: the cost is per token (nothing tells a per-cycle part apart)
        return (my, 0.0) if mx == 0 else (0.0, my / mx)
    b = sum((x - mx) * (y - my) for x, y in pts) / var
    if b >= 0 and my - b * mx >= 0:
        return my - b * mx, b
    sxx = sum(x * x for x, _ in pts)
    through_origin = sum(x * y for x, y in pts) / sxx if sxx else 0.0
    # the better of the two one-parameter fits: a line through the origin, or a flat cost per cycle
    err = lambda a, b: sum((y - a - b * x) ** 2 for x, y in pts)  # noqa: E731
    return min([(0.0, through_origin), (my, 0.0)], key=lambda ab: err(*ab))


def _drafted(r: CycleRecord) -> int:
    """Tokens the drafter gave (traces from before `drafted` was recorded: those verified)."""
    return r.drafted if r.drafted is not None else len(r.proposed)


def _proposing_always(blocks, no_match: float):
    """The blocks had the `no_match` share of cycles (asked, nothing proposed) proposed as the proposing cycles do:
    that share moves from the empty block to the others in proportion. None when there is nothing to move."""
    empty = sum(w for w, n, _ in blocks if n == 0)
    rest = sum(w for w, n, _ in blocks if n > 0)
    moved = min(no_match, empty)
    if moved <= 0 or rest <= 0:
        return None
    return [(w - moved if n == 0 else w * (1 + moved / rest), n, a) for w, n, a in blocks]


def _unexplained(steady: list[CycleRecord], draft_cost, curve, overhead: float, top: int = 5,
                 blocks=None) -> dict:
    """Where the cost model misses: each cycle's time against what its proposal length predicts (drafting, the
    verify curve, the mean overhead) -> the total gap and the cycles furthest off; or, where the time is right,
    the tokens a cycle emitted against those the acceptance by position expects (`blocks`, predicted_speedup's)."""
    a, b = draft_cost
    rows = []
    for r in steady:
        n = len(r.proposed)
        predicted = (a + b * n if asked_of(r) > 0 else 0.0) + interpolate(curve, n + 1) + overhead
        rows.append((r.cycle_ms - predicted, r.cycle, n, r.cycle_ms, predicted))
    gap = sum(x[0] for x in rows)
    worst = sorted(rows, key=lambda x: -abs(x[0]))[:top]
    if blocks and abs(gap) <= TIME_EXPLAINED * sum(r.cycle_ms for r in steady):  # the time is right: the tokens
        expected = sum(w * expected_tokens(alphas, n) for w, n, alphas in blocks)
        emitted = sum(len(r.emitted) for r in steady) / len(steady)
        finding = (f"the cycles take what their proposal lengths predict ({gap:+.1f} ms in all), but emitted "
                   f"{emitted:.2f} tokens each where the acceptance by position expects {expected:.2f} (a proposal "
                   f"length seen in fewer than {MIN_GROUP} cycles is priced at all cycles' odds by position: a "
                   "prediction's long proposals accepted whole beat them)")
    else:
        finding = (f"the cycles take {gap:+.1f} ms in all against what their proposal lengths predict; the furthest "
                   "off: " + ", ".join(f"cycle {c} ({ms:.1f} ms, predicted {p:.1f})" for _, c, _, ms, p in worst[:3])
                   + " (one-time work, or the machine's load changing during the run)")
    return {"gap_ms": round(gap, 3), "cycles": [{"cycle": c, "proposed": n, "ms": round(ms, 3),
                                                  "predicted_ms": round(p, 3)} for _, c, n, ms, p in worst],
            "finding": finding}


def _stale_costs(priced: dict | None, measured: dict, seen: Counter, min_cycles: int = 3) -> str | None:
    """How the curve the policy priced with (`priced`, rows -> ms) disagrees with the passes measured, or None."""
    if not priced or not measured:
        return None
    priced = {int(n): float(v) for n, v in priced.items()}
    one = measured.get(1) if seen.get(1, 0) >= min_cycles else None
    for n, ms in sorted(priced.items()):
        got = measured.get(n) if seen.get(n, 0) >= min_cycles else None
        if got and not 1 / STALE <= ms / got <= STALE:
            return (f"the policy priced a {n}-row pass at {ms:.1f} ms; the trace's {seen[n]} such passes took "
                    f"{got:.1f} ms")
        if one and n > 1 and ms > one * (1 + ROW_MAX * (n - 1)):
            return (f"the policy priced a {n}-row pass at {ms:.1f} ms, {ms / one:.1f} one-row passes ({one:.1f} ms "
                    f"measured): no machine costs that, so it never drafted to find out")
    return None


def analyze(records: list[CycleRecord], decode_only: bool = False, target_curve: dict | None = None) -> dict:
    """The report for one trace (or, decode_only=True, for cycles already stripped of their prefill cycle).
    `target_curve`: the target's verify ms by tokens, measured apart (a trace's meta): sizes the trace never
    verified, above all one target step when every cycle drafted, come from it."""
    if not records:
        raise SpecDecError("the trace has no cycle records")
    cycles = records if decode_only else _decode(records)
    tokens = sum(len(r.emitted) for r in cycles)
    proposed = sum(len(r.proposed) for r in cycles)
    accepted = sum(r.accepted for r in cycles)
    draft_ms = sum(r.draft_ms for r in cycles)
    verify_ms = sum(r.verify_ms for r in cycles)
    total_ms = sum(r.cycle_ms for r in cycles)
    other_ms = sum(max(0.0, r.cycle_ms - r.draft_ms - r.verify_ms) for r in cycles)
    # per-cycle costs from the cycles without one-time work; the prediction is compared with their speed
    once = one_time_costs(cycles)
    steady = [r for i, r in enumerate(cycles) if i not in once]
    one_time_ms = sum(once.values())
    curve = verify_curve(steady, skip_prefill=False)
    stale = _stale_costs(target_curve, curve, Counter(len(r.proposed) + 1 for r in steady))
    if target_curve:  # sizes the trace never verified (one target step, above all) from the curve measured apart
        seen = Counter(len(r.proposed) + 1 for r in cycles)
        extra = {n: v for n, v in target_curve.items() if n not in curve}
        curve = non_decreasing({**extra, **curve}, {n: seen.get(n, 1) for n in {**extra, **curve}})
    t1 = interpolate(curve, 1)  # one target step: what target-only decoding pays per token
    by_pos = acceptance_by_position(cycles)
    alphas = _filled(by_pos)
    tau = Counter(r.tau for r in cycles).most_common(1)[0][0]
    lengths = {n: c / len(cycles) for n, c in Counter(len(r.proposed) for r in cycles).items()}
    blocks = []  # (share, length, acceptance by position over the cycles that proposed that many)
    for n, w in sorted(lengths.items()):
        group = [r for r in cycles if len(r.proposed) == n]
        own = acceptance_by_position(group) if n and len(group) >= MIN_GROUP else []
        blocks.append((w, n, _filled(own) if own else alphas))
    draft_cost = _fit_draft(steady)
    overhead = sum(max(0.0, r.cycle_ms - r.draft_ms - r.verify_ms) for r in steady) / len(steady)

    def model(t: int) -> float:  # at τ = 0 the drafter is never asked: no lookup cost either
        return predicted_speedup(blocks_at(blocks, tau, t), draft_cost if t else (0.0, 0.0), curve, overhead, t1)

    def speedup(time_ms: float) -> float:
        return tokens * t1 / time_ms if time_ms > 0 else float("inf")

    # what was asked of the drafter, what it gave, and why fewer drafts than τ were verified
    asked = [r for r in cycles if asked_of(r) > 0]
    gave = [r for r in asked if _drafted(r) > 0]
    no_match = (len(asked) - len(gave)) / len(cycles)
    shortfalls = Counter(r.short for r in cycles if r.short)
    filled = sum(1 for r in gave if len(r.proposed) >= r.tau > 0) / len(gave) if gave else 0.0

    measured = speedup(total_ms)
    measured_steady = speedup(total_ms - one_time_ms)  # what the cost model predicts: one-time work left out
    predicted = model(tau)
    best_tau = max(range(MAX_TAU + 1), key=model)
    gains = {
        "draft_cost": speedup(total_ms - draft_ms),
        "verify_cost": speedup(total_ms - verify_ms + t1 * len(cycles)),
        "overhead": speedup(total_ms - other_ms),
    }
    if best_tau != tau and model(best_tau) > predicted:
        gains["tau_too_large" if best_tau < tau else "tau_too_small"] = measured * model(best_tau) / predicted
    every = _proposing_always(blocks, no_match)
    if every is not None:  # the cycles without a match proposing as the others do
        gains["rare_proposals"] = measured * predicted_speedup(blocks_at(every, tau, tau), draft_cost, curve,
                                                               overhead, t1) / predicted
    ceiling = tokens / len(cycles)  # tokens per target pass

    if stale is not None and shortfalls.get("budget", 0) >= STALE_CUT * len(cycles):  # the prices, not the draft:
        # compared before acceptance is blamed
        bottleneck = "stale_costs"
    elif shortfalls.get("put_off", 0) >= PUT_OFF_CUT * len(cycles):  # the draft never ran for those requests
        bottleneck = "put_off"
    elif not asked:  # target-only (or τ 0 throughout): no drafter to diagnose
        bottleneck = "none"
    elif ceiling < LOW_CEILING:
        rare = gains.get("rare_proposals", 0.0) > measured * (1 + NONE_MARGIN)
        bottleneck = "rare_proposals" if rare else "low_acceptance"
    else:
        top = max(gains, key=gains.get)
        bottleneck = top if gains[top] > measured * (1 + NONE_MARGIN) else "none"
    why = {
        "low_acceptance": f"{ceiling:.2f} tokens per target pass (acceptance "
                          f"{accepted / proposed if proposed else 0:.2f}, drafts in "
                          f"{100 * (1 - lengths.get(0, 0)):.0f}% of cycles): even free drafting and one-step "
                          "verification would barely beat target-only",
        "draft_cost": f"drafting is {100 * draft_ms / total_ms:.0f}% of the time "
                      f"({draft_cost[1] / t1 if t1 else 0:.2f} target steps per draft token)",
        "verify_cost": f"verification is {100 * verify_ms / total_ms:.0f}% of the time; a pass over "
                       f"{tau + 1} tokens costs {interpolate(curve, tau + 1) / t1 if t1 else 0:.2f} target steps",
        "overhead": f"{100 * other_ms / total_ms:.0f}% of the time is outside drafting and verifying "
                    f"({overhead:.1f} ms per cycle)",
        "rare_proposals": f"the drafter proposed in {len(gave)} of the {len(asked)} cycles it was asked "
                          f"({100 * len(gave) / max(1, len(asked)):.0f}%); when it proposed, "
                          f"{sum(r.accepted for r in gave) / max(1, sum(len(r.proposed) for r in gave)):.2f} of its "
                          f"drafts were accepted ({sum(len(r.emitted) for r in gave) / max(1, len(gave)):.2f} tokens "
                          "a pass)",
        "tau_too_large": f"tau={tau}; the measured acceptance by position favours tau={best_tau}",
        "tau_too_small": f"tau={tau}; {100 * filled:.0f}% of the proposals filled it, and their acceptance by "
                         f"position favours tau={best_tau}",
    }
    advice = dict(ADVICE)
    if best_tau >= tau:  # a smaller tau cannot help: the curve itself is what costs
        advice["verify_cost"] = ADVICE["verify_cost_at_best_tau"].format(best_tau=best_tau)
    findings = sorted(({"kind": k, "speedup_if_fixed": round(v, 3), "gain": round(v / measured, 3),
                        "finding": why[k], "recommendation": advice[k]} for k, v in gains.items()),
                      key=lambda f: -f["speedup_if_fixed"])
    if bottleneck == "stale_costs":
        findings.insert(0, {"kind": "stale_costs", "speedup_if_fixed": None, "gain": None, "finding": stale,
                            "recommendation": ADVICE["stale_costs"]})
    if bottleneck == "put_off":
        findings.insert(0, {"kind": "put_off", "speedup_if_fixed": None, "gain": None,
                            "finding": f"{shortfalls['put_off']} of {len(cycles)} cycles drafted nothing: their "
                                       "requests' draft model never caught up on the prompt (put off: it could not "
                                       "pay at the load then)", "recommendation": ADVICE["put_off"]})
    if bottleneck == "low_acceptance":
        findings.insert(0, {"kind": "low_acceptance", "speedup_if_fixed": None, "gain": None,
                            "finding": why["low_acceptance"], "recommendation": ADVICE["low_acceptance"]})
    predicted_error = predicted / measured_steady - 1 if measured_steady else None
    unexplained = None
    if predicted_error is not None and abs(predicted_error) > EXPLAIN_MARGIN:
        unexplained = _unexplained(steady, draft_cost, curve, overhead, blocks=blocks)
    return {
        "summary": {"cycles": len(cycles), "new_tokens": tokens, "proposed": proposed, "accepted": accepted,
                    "acceptance_rate": round(accepted / proposed, 4) if proposed else None,
                    "mean_accepted_len": round(accepted / len(cycles), 4), "tau": tau,
                    "mean_proposed": round(proposed / len(cycles), 3),
                    "asked_cycles": len(asked),
                    "proposal_rate": round(len(gave) / len(asked), 4) if asked else None,
                    "shortfalls": dict(shortfalls.most_common()),
                    "tokens_per_s": round(tokens / total_ms * 1e3, 3) if total_ms else None,
                    "target_passes_per_token": round(len(cycles) / tokens, 4) if tokens else None},
        "acceptance_by_position": by_pos,
        "proposal_lengths": {str(n): round(w, 4) for n, w in sorted(lengths.items())},
        "time_split": {"draft_ms": round(draft_ms, 3), "verify_ms": round(verify_ms, 3),
                       "other_ms": round(other_ms, 3), "draft_frac": round(draft_ms / total_ms, 4),
                       "verify_frac": round(verify_ms / total_ms, 4), "other_frac": round(other_ms / total_ms, 4)},
        "costs": {"target_step_ms": round(t1, 3), "draft_ms_per_cycle": round(draft_cost[0], 3),
                  "draft_ms_per_token": round(draft_cost[1], 3),
                  "draft_cost_ratio": round(draft_cost[1] / t1, 4) if t1 else None,
                  "overhead_ms_per_cycle": round(overhead, 3),
                  "verify_ms_by_tokens": {str(k): round(v, 3) for k, v in curve.items()}},
        "speedup": {"measured": round(measured, 3), "measured_per_cycle": round(measured_steady, 3),
                    "one_time_ms": round(one_time_ms, 3), "predicted": round(predicted, 3),
                    "prediction_error": round(predicted_error, 4) if predicted_error is not None else None,
                    "unexplained": unexplained,
                    "ceiling": round(ceiling, 3), "best_tau": best_tau,
                    "predicted_at_best_tau": round(model(best_tau), 3)},
        "bottleneck": bottleneck,
        "findings": findings,
        "trees": tree_stats(cycles, curve),
    }


def analyze_many(traces: dict[str, tuple[list[CycleRecord], dict]]) -> dict:
    """Several traces (a server's --trace-dir, or many --trace files) together: the report over all their decode
    cycles, one line per trace, and the outliers (a speedup a quarter off the median, or a bottleneck other than
    most traces')."""
    per = {name: analyze(recs, target_curve=step_curve(meta)) for name, (recs, meta) in traces.items()}
    curves = [c for _, meta in traces.values() if (c := step_curve(meta))]
    merged = analyze([r for recs, _ in traces.values() for r in _decode(recs)], decode_only=True,
                     target_curve={n: median(c[n] for c in curves if n in c) for n in set().union(*curves)}
                     if curves else None)
    mid = median(p["speedup"]["measured"] for p in per.values())
    rows = [{"trace": name, "cycles": p["summary"]["cycles"], "measured": p["speedup"]["measured"],
             "predicted": p["speedup"]["predicted"], "bottleneck": p["bottleneck"]} for name, p in per.items()]
    usual = Counter(r["bottleneck"] for r in rows).most_common(1)[0][0]
    outliers = [r for r in rows if abs(r["measured"] / mid - 1) > 0.25 or r["bottleneck"] != usual]
    return {**merged, "traces": rows, "outliers": outliers}


def load_traces(paths: list[str]) -> dict[str, tuple[list[CycleRecord], dict]]:
    files = []
    for p in map(Path, paths):
        files += sorted(p.glob("*.jsonl")) if p.is_dir() else [p]
    if not files:
        raise SpecDecError(f"no trace files (*.jsonl) in {', '.join(paths)}")
    traces = {}
    for f in files:
        try:
            traces[str(f)] = read_trace(f)
        except OSError as e:
            raise SpecDecError(f"cannot read trace {f}: {e.strerror}")
        except (json.JSONDecodeError, TypeError) as e:
            raise SpecDecError(f"{f} is not a specdec trace (one JSON cycle record per line): {e}")
        if not traces[str(f)][0]:
            raise SpecDecError(f"the trace {f} has no cycle records")
    return traces


def position_groups(alphas: list, single: int = 8) -> list[tuple[str, float | None]]:
    """(column label, alpha) for the report's table: positions 1..`single` apart, then doubling ranges (9-16,
    17-32, ...) with the mean of their measured alphas, so a long proposal (a prediction's 32 tokens) fits a line."""
    out = [(str(k + 1), a) for k, a in enumerate(alphas[:single])]
    lo = single + 1
    while lo <= len(alphas):
        hi = min(len(alphas), 2 * (lo - 1))
        seen = [a for a in alphas[lo - 1:hi] if a is not None]
        out.append((f"{lo}-{hi}" if hi > lo else str(lo), sum(seen) / len(seen) if seen else None))
        lo = hi + 1
    return out
