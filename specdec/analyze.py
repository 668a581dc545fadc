"""`specdec analyze TRACE.jsonl`: why was this run fast or slow?

Reads per-cycle records (from `generate --trace` or the server's --trace-dir) and reports summary metrics,
acceptance by position, the time split, the measured speedup against the cost model's prediction, and a
diagnosis naming the bottleneck with a concrete recommendation.
"""
from __future__ import annotations

import json
from statistics import mean

from .errors import SpecDecError
from .costs import cost_model, interpolate, verify_curve
from .trace import CycleRecord, acceptance_by_position, read_jsonl

BOTTLENECKS = ("low_acceptance", "draft_cost", "verify_cost", "overhead", "tau_too_large", "tau_too_small", "none")
MAX_TAU = 16


def analyze(records: list[CycleRecord]) -> dict:
    if not records:
        raise SpecDecError("the trace has no cycle records")
    tokens = sum(len(r.emitted) for r in records)
    proposed = sum(len(r.proposed) for r in records)
    accepted = sum(r.accepted for r in records)
    draft_ms = sum(r.draft_ms for r in records)
    verify_ms = sum(r.verify_ms for r in records)
    total_ms = sum(r.cycle_ms for r in records)
    other_ms = max(0.0, total_ms - draft_ms - verify_ms)
    by_pos = acceptance_by_position(records)
    alphas = [a for a in by_pos if a is not None]
    curve = verify_curve(records)
    t_target = interpolate(curve, 1)  # one target step: what target-only decoding pays per token
    mean_tau = mean(r.tau for r in records)
    drafted_cycles = [r for r in records if r.proposed]
    c_ms = (sum(r.draft_ms for r in drafted_cycles) / max(1, sum(len(r.proposed) for r in drafted_cycles))
            if drafted_cycles else 0.0)
    overhead = other_ms / len(records)
    acc_rate = accepted / proposed if proposed else 0.0
    measured = tokens / total_ms * t_target if total_ms else 0.0
    tau_used = max(0, round(mean_tau))
    asked = [r for r in records if r.tau > 0]
    match = len(drafted_cycles) / len(asked) if asked else 1.0  # share of cycles that got a draft at all
    predicted = (cost_model(alphas, tau_used, c_ms, curve, overhead, t_target, match)
                 if alphas or tau_used == 0 else None)
    best_tau = max(range(0, MAX_TAU + 1),
                   key=lambda t: cost_model(alphas, t, c_ms, curve, overhead, t_target, match))
    best = cost_model(alphas, best_tau, c_ms, curve, overhead, t_target, match)
    growth = interpolate(curve, tau_used + 1) / t_target if t_target else 1.0

    findings = []
    if other_ms / total_ms > 0.25:
        findings.append(("overhead", f"{100 * other_ms / total_ms:.0f}% of the time is outside draft and verify "
                         f"({overhead:.1f} ms per cycle)", "profile the loop: tokenizer decoding, stop-string "
                         "checks, logging or I/O inside the cycle; batch or move them out of the hot path"))
    if growth > 1.6 and len(curve) > 1:
        findings.append(("verify_cost", f"verifying {tau_used + 1} tokens costs {growth:.1f}x one target step "
                         f"({interpolate(curve, tau_used + 1):.1f} vs {t_target:.1f} ms): parallel verification is not "
                         "paying", f"use a smaller tau (the cost model suggests {best_tau}), or a backend whose "
                         "multi-token pass is memory bound (GPU, fused kernels)"))
    c_ratio = c_ms / t_target if t_target else 0.0
    alpha1 = alphas[0] if alphas else 0.0  # Leviathan's alpha: a draft token's chance of acceptance
    if drafted_cycles and c_ratio > 0.1 and c_ratio >= 0.5 * alpha1:
        findings.append(("draft_cost", f"one draft token costs {c_ratio:.2f} of a target step while its first "
                         f"token is accepted only {100 * alpha1:.0f}% of the time", "use a cheaper draft (fewer "
                         "layers, a reduced-vocabulary head) or the n-gram drafter; speculation pays only when "
                         "acceptance clearly exceeds the draft/target cost ratio"))
    if proposed and alpha1 < 0.4:
        findings.append(("low_acceptance", f"acceptance rate {acc_rate:.2f}; the target already rejects the first "
                         f"draft token {100 * (1 - alpha1):.0f}% of the time", "use a draft closer to the target "
                         "(distil it on the target's outputs: specdec distill), check that the prompt format "
                         "(chat template) matches, or stop speculating (--draft none / --policy adaptive)"))
    if predicted is not None and best > 1.1 * predicted and best_tau != tau_used:
        kind = "tau_too_large" if best_tau < tau_used else "tau_too_small"
        drop = next((k + 1 for k, a in enumerate(alphas) if a < 0.5), None)
        where = f"; acceptance falls below 0.5 at draft position {drop}" if drop else ""
        findings.append((kind, f"tau={tau_used} but the measured acceptance by position favours tau={best_tau} "
                         f"(predicted speedup {best:.2f}x vs {predicted:.2f}x){where}",
                         f"run with --tau {best_tau}, or --policy adaptive to choose it per cycle"))
    bottleneck = findings[0][0] if findings else "none"
    return {
        "summary": {"cycles": len(records), "new_tokens": tokens, "proposed": proposed, "accepted": accepted,
                    "acceptance_rate": round(acc_rate, 4) if proposed else None,
                    "mean_accepted_len": round(accepted / len(records), 4), "mean_tau": round(mean_tau, 3),
                    "tokens_per_s": round(tokens / total_ms * 1e3, 3) if total_ms else None,
                    "target_passes_per_token": round(len(records) / tokens, 4) if tokens else None},
        "acceptance_by_position": by_pos,
        "time_split": {"draft_ms": round(draft_ms, 3), "verify_ms": round(verify_ms, 3),
                       "other_ms": round(other_ms, 3), "draft_frac": round(draft_ms / total_ms, 4),
                       "verify_frac": round(verify_ms / total_ms, 4), "other_frac": round(other_ms / total_ms, 4)},
        "costs": {"target_step_ms": round(t_target, 3), "draft_ms_per_token": round(c_ms, 3),
                  "draft_cost_ratio": round(c_ratio, 4), "overhead_ms_per_cycle": round(overhead, 3),
                  "verify_ms_by_tokens": {str(k): round(v, 3) for k, v in curve.items()}},
        "speedup": {"measured_vs_target_step": round(measured, 3),
                    "predicted": round(predicted, 3) if predicted is not None else None,
                    "best_tau": best_tau, "predicted_at_best_tau": round(best, 3)},
        "bottleneck": bottleneck,
        "findings": [{"kind": k, "finding": f, "recommendation": r} for k, f, r in findings],
    }


def print_report(rep: dict) -> None:
    from rich.console import Console
    from rich.table import Table

    con = Console(width=110)
    s, t, c, sp = rep["summary"], rep["time_split"], rep["costs"], rep["speedup"]
    con.print(f"[bold]{s['new_tokens']} tokens in {s['cycles']} cycles[/]  acceptance {s['acceptance_rate']}  "
              f"mean accepted {s['mean_accepted_len']}  mean tau {s['mean_tau']}  {s['tokens_per_s']} tok/s")
    pos = Table(title="acceptance by draft position (alpha_k)")
    for k in range(len(rep["acceptance_by_position"])):
        pos.add_column(str(k + 1), justify="right")
    pos.add_row(*["-" if a is None else f"{a:.2f}" for a in rep["acceptance_by_position"]])
    con.print(pos)
    con.print(f"time: draft {100 * t['draft_frac']:.0f}%  verify {100 * t['verify_frac']:.0f}%  "
              f"other {100 * t['other_frac']:.0f}%   target step {c['target_step_ms']} ms, draft token "
              f"{c['draft_ms_per_token']} ms (ratio {c['draft_cost_ratio']}), verify ms by tokens "
              f"{c['verify_ms_by_tokens']}")
    con.print(f"speedup vs target-only: measured {sp['measured_vs_target_step']}x, cost model "
              f"{sp['predicted']}x; best tau {sp['best_tau']} -> {sp['predicted_at_best_tau']}x")
    con.print(f"[bold]bottleneck: {rep['bottleneck']}[/]")
    for f in rep["findings"]:
        con.print(f" - {f['kind']}: {f['finding']}\n   -> {f['recommendation']}")


def cmd_analyze(args) -> int:
    try:
        records = read_jsonl(args.trace)
    except OSError as e:
        raise SpecDecError(f"cannot read trace {args.trace}: {e.strerror}")
    except (json.JSONDecodeError, TypeError) as e:
        raise SpecDecError(f"{args.trace} is not a specdec trace (one JSON cycle record per line): {e}")
    rep = analyze(records)
    if args.json:
        print(json.dumps(rep, indent=2))
    else:
        print_report(rep)
    return 0


def register(sub, model_args, sampling_args):
    a = sub.add_parser("analyze", help="diagnose a trace written by generate --trace or the server")
    a.add_argument("trace")
    a.add_argument("--json", action="store_true")
    a.set_defaults(func=cmd_analyze)
