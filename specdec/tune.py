"""`specdec tune`: the draft/τ advisor.

1. measure the target's verify cost as a curve T_verify(n) for n = 1..τmax+1 tokens (not a constant: it grows
   once the target is compute bound);
2. for each candidate draft, run it at τmax on sample prompts and measure acceptance by position α_k, draft time
   per token and per-cycle overhead;
3. predict the speedup of every (draft, τ) with the cost model (costs.py), confirm the best few by real
   runs side by side with target-only, and recommend one with a plain-language reason — or recommend not
   speculating when nothing beats target-only.
"""
from __future__ import annotations

import json

from .costs import cost_model, measure_verify_curve
from .cli import backend_arg
from .api import SpecDecoder, encode_prompt
from .bench import Bench
from .errors import InvalidRequest, SpecDecError
from .prompts import load_prompts
from .trace import acceptance_by_position, tree_stats


def profile_draft(decoder: SpecDecoder, prompts: list[dict], tau: int, max_new_tokens: int,
                  curve: dict | None = None) -> dict:
    """Acceptance by position, draft ms per token and overhead per cycle, measured at a fixed τ; for a drafter
    that makes token trees also trace.tree_stats (with `curve`: the tree size that would have paid best)."""
    records = []
    for p in prompts:
        records += decoder.generate(p["prompt"], max_new_tokens=max_new_tokens, chat=p["chat"], tau=tau,
                                    policy="fixed").records[1:]  # cycle 0 carries the prefill
    proposed = sum(len(r.proposed) for r in records)
    drafted = [r for r in records if r.proposed]
    alphas = [a if a is not None else 0.0 for a in acceptance_by_position(drafted)] or [0.0]
    alphas += [alphas[-1]] * (tau - len(alphas))  # positions never reached: assume no better than the last
    return {
        "alphas": [round(a, 4) for a in alphas],
        "acceptance_rate": round(sum(r.accepted for r in records) / proposed, 4) if proposed else 0.0,
        "match_rate": round(len(drafted) / max(1, len(records)), 4),  # cycles that got any draft at all
        "draft_ms_per_token": round(sum(r.draft_ms for r in drafted) / max(1, proposed), 4),
        "overhead_ms": round(sum(r.cycle_ms - r.draft_ms - r.verify_ms for r in records) / max(1, len(records)), 4),
        "cycles": len(records),
        **({"trees": trees} if (trees := tree_stats(records, curve)) else {}),
    }


def reason(best: dict, drafts: dict, t_target: float, confirmed: list[dict]) -> str:
    """Plain facts behind the pick: what it measured, why (acceptance, draft cost, how often it drafts), and the
    runner-up it beat."""
    d = drafts[best["draft"]]
    text = (f"draft {best['draft']} at tau={best['tau']}: measured {best['measured_speedup']:.2f}x over target-only "
            f"(predicted {best['predicted_speedup']:.2f}x); its first draft token is accepted "
            f"{d['alphas'][0]:.0%} of the time (acceptance rate {d['acceptance_rate']:.2f}), one draft token costs "
            f"{d['draft_ms_per_token'] / t_target:.3f} of a target step, and it drafts in {d['match_rate']:.0%} of "
            f"cycles")
    others = [p for p in confirmed if p is not best]
    if others:
        nxt = max(others, key=lambda p: p["measured_speedup"])
        text += f"; runner-up {nxt['draft']} tau={nxt['tau']} measured {nxt['measured_speedup']:.2f}x"
    return text


def tune(target: str, drafts: list[str], max_tau: int, prompts: list[dict], max_new_tokens: int, confirm: int,
         loaded=None, backend: str = "auto", numerics: str = "auto") -> dict:
    if max_tau < 1 or confirm < 1 or max_new_tokens < 2:
        raise InvalidRequest("--max-tau and --confirm must be >= 1, --max-new-tokens >= 2")
    bench = Bench(target, drafts, [max_tau], max_new_tokens, compare_hf=False, loaded=loaded, backend=backend,
                  numerics=numerics)
    vocab = bench.model.config.vocab_size
    probe_ids = encode_prompt(bench.tok, prompts[0]["prompt"], prompts[0]["chat"])
    curve = measure_verify_curve(bench.model, vocab, probe_ids, max_tau + 1)
    t_target = curve[1]
    profiles, predictions = {}, []
    for name in drafts:
        dec = bench.decoder_for(name, max_tau)
        profiles[name] = prof = profile_draft(dec, prompts, max_tau, max_new_tokens, curve)
        for tau in range(1, max_tau + 1):
            predictions.append({"draft": name, "tau": tau, "predicted_speedup": round(cost_model(
                prof["alphas"], tau, prof["draft_ms_per_token"], curve, prof["overhead_ms"], t_target,
                prof["match_rate"]), 4)})
    top = sorted(predictions, key=lambda p: -p["predicted_speedup"])[:confirm]
    confirm_bench = Bench(target, sorted({p["draft"] for p in top}), [], max_new_tokens, compare_hf=False,
                          loaded=(bench.model, bench.tok, bench.draft_models), backend=backend,
                          configs=[(p["draft"], p["tau"]) for p in top])
    measured = {(r["draft"], r["tau"]): r for r in confirm_bench.run(prompts)}
    for p in top:
        r = measured[(p["draft"], p["tau"])]
        p.update(measured_speedup=r["speedup"], identical_to_baseline=r["identical_to_baseline"],
                 tokens_per_s=r["tokens_per_s"])
    best = max(top, key=lambda p: p["measured_speedup"])
    if best["measured_speedup"] <= 1.0:
        recommendation = {"draft": "none", "tau": None, "reason": (
            f"no configuration beat target-only decoding (best: {best['draft']} tau={best['tau']} at "
            f"{best['measured_speedup']:.2f}x): do not speculate with these drafts on this machine")}
    else:
        recommendation = {"draft": best["draft"], "tau": best["tau"], "reason": reason(best, profiles, t_target, top)}
    return {"verify_ms_by_tokens": {str(k): round(v, 3) for k, v in curve.items()}, "target_step_ms": t_target,
            "drafts": profiles, "predictions": predictions, "confirmed": top, "recommendation": recommendation}


def plot(report: dict, path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for name in report["drafts"]:
        pts = [p for p in report["predictions"] if p["draft"] == name]
        line, = ax.plot([p["tau"] for p in pts], [p["predicted_speedup"] for p in pts], marker=".",
                        label=f"{name} (predicted)")
        conf = [p for p in report["confirmed"] if p["draft"] == name]
        if conf:
            ax.scatter([p["tau"] for p in conf], [p["measured_speedup"] for p in conf], marker="o", s=60,
                       facecolors="none", edgecolors=line.get_color(), label=f"{name} (measured)")
    ax.axhline(1.0, color="grey", linestyle="--", linewidth=1, label="target-only")
    ax.set_xlabel("tau (draft tokens per cycle)")
    ax.set_ylabel("speedup over target-only")
    ax.set_title("specdec tune: " + report["recommendation"]["reason"][:70] + "…", fontsize=8)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def cmd_tune(args) -> int:
    from .api import default_draft
    prompts = load_prompts(args.prompts)[: args.limit or None]
    default = default_draft(args.target)
    drafts = args.draft or list(dict.fromkeys([default, *default.split("+"), "ngram"]))
    report = tune(args.target, drafts, args.max_tau, prompts, args.max_new_tokens, args.confirm,
                  backend=args.backend, numerics=args.numerics)
    try:
        if args.plot:
            plot(report, args.plot)
        if args.json:
            with open(args.json, "w") as f:
                json.dump(report, f, indent=2)
    except OSError as e:
        raise SpecDecError(f"cannot write output: {e}")
    curve = ", ".join(f"{k}:{v:.1f}" for k, v in report["verify_ms_by_tokens"].items())
    print(f"target verify ms by tokens: {curve}")
    for name, d in report["drafts"].items():
        print(f"draft {name}: acceptance by position {d['alphas']}, {d['draft_ms_per_token']:.2f} ms/token")
        if "trees" in d:
            t = d["trees"]
            print(f"  token trees: {t['nodes_per_pass']} nodes per pass (sized by the cost model), accepted depth "
                  f"{t['accepted_depth']}; trees cut to {t['best_nodes']} nodes would have paid best "
                  f"({t['speedup_with_nodes'][str(t['best_nodes'])]:.2f}x in verify time)")
    for p in report["confirmed"]:
        print(f"  {p['draft']} tau={p['tau']}: predicted {p['predicted_speedup']:.2f}x, measured "
              f"{p['measured_speedup']:.2f}x{'' if p['identical_to_baseline'] else '  (OUTPUT DIFFERS!)'}")
    rec = report["recommendation"]
    print(f"recommendation: {rec['draft']}" + (f" --tau {rec['tau']}" if rec["tau"] else "") + f"\n  {rec['reason']}")
    return 0


def register(sub, model_args, sampling_args):
    t = sub.add_parser("tune", help="measure drafts and tau, predict with the cost model, recommend one")
    t.add_argument("--target", default="default")
    t.add_argument("--draft", action="append",
                   help="candidate draft (repeatable): shipped, ngram, target, a draft dir/.gguf, or A+B")
    t.add_argument("--max-tau", type=int, default=6)
    backend_arg(t)
    t.add_argument("--prompts", default=None)
    t.add_argument("--limit", type=int, default=6, help="prompts used (0 = all)")
    t.add_argument("--max-new-tokens", type=int, default=48)
    t.add_argument("--confirm", type=int, default=3, help="confirm the best N predictions by real runs")
    t.add_argument("--plot", default="tune.png")
    t.add_argument("--json", default="tune.json")
    t.set_defaults(func=cmd_tune)
