"""`specdec analyze` on real traces.

Default model, in process: each setup generates with --trace (fixed τ), the analyzer reads the trace, and
target-only runs of the same prompts, interleaved, give the actual speedup the analyzer's measured one should agree
with.

The real pair over HTTP (--pair): each setup is a `specdec serve` on Qwen2.5-Coder 1.5B with --trace-dir, fed the
pair prompts (completion, chat, edits). The analyzer names each setup's bottleneck and the speedup if it were fixed;
the fix is then applied (a chain behind a drafter that rarely proposes, the suggested τ, a cheaper draft, no draft)
and the setup served again: the prediction is checked against the rerun's measured speedup.

    python benchmarks/serve.py diagnosis --out docs/diagnosis.json
    python benchmarks/serve.py diagnosis --pair --out docs/diagnosis_pair.json
    python benchmarks/serve.py diagnosis --pair --no-fix --html docs/reports \
        --setups "target-only,default,0.5B,0.5B tau=8 fixed"   # each setup's report page and its screenshot
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from specdec import SpecDecoder
from specdec.analyze import analyze
from specdec.costs import measure_verify_curve
from specdec.report import write_report

SETUPS = [("target", 6), ("shipped", 8), ("ngram", 6), ("datastore+ngram", 3)]
PROMPTS = ["Explain how a hash table works.", "Write a Python function that checks whether a string is a palindrome.",
           "What are three tips for writing clear emails?"]


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--max-new-tokens", type=int, default=48)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--pair", action="store_true", help="the real pair's servers (benchmarks/pair.py fetches it)")
    ap.add_argument("--out", default=None)
    ap.add_argument("--html", default=None, help="--pair: write each setup's report (and a screenshot) in this folder")
    ap.add_argument("--setups", default=None, help="--pair: comma-separated setups (default: all)")
    ap.add_argument("--no-fix", dest="fix", action="store_false", help="--pair: do not serve each fix again")
    args = ap.parse_args()
    if args.pair:
        return pair_suite(args)
    alone = SpecDecoder(draft="none")
    setups = {f"{d} tau={t}": SpecDecoder(draft=d, tau=t, policy="fixed") for d, t in SETUPS}
    wall = {name: 0.0 for name in [*setups, "target-only"]}
    records = {name: [] for name in setups}
    tokens = {name: 0 for name in wall}
    for _ in range(args.rounds):  # setups interleaved with target-only, prompt by prompt
        for p in PROMPTS:
            for name, sd in [*setups.items(), ("target-only", alone)]:
                t = time.perf_counter()
                out = sd.generate(p, max_new_tokens=args.max_new_tokens)
                wall[name] += time.perf_counter() - t
                tokens[name] += len(out.token_ids)
                if name in records:
                    records[name].append(out.records)
    # what `generate --trace` stores beside the records: the target's verify curve, measured apart
    curve = measure_verify_curve(alone.model, alone.model.config.vocab_size, alone.encode(PROMPTS[0]), 9, reps=7)
    rows = []
    for name in setups:
        decode = [r for recs in records[name] for r in recs[1:]]  # each generation's decode cycles
        rep = analyze(decode, decode_only=True, target_curve=curve)
        actual = (tokens[name] / wall[name]) / (tokens["target-only"] / wall["target-only"])
        rows.append({"setup": name, "bottleneck": rep["bottleneck"], "measured": rep["speedup"]["measured"],
                     "predicted": rep["speedup"]["predicted"], "prediction_error": rep["speedup"]["prediction_error"],
                     "actual_end_to_end": round(actual, 3), "ceiling": rep["speedup"]["ceiling"],
                     "gains": {f["kind"]: f["speedup_if_fixed"] for f in rep["findings"]}, "report": rep})
        print(f"{name}: bottleneck {rep['bottleneck']}, measured {rep['speedup']['measured']}x, predicted "
              f"{rep['speedup']['predicted']}x, end to end {actual:.2f}x, gains {rows[-1]['gains']}", file=sys.stderr)
    if args.out:
        Path(args.out).write_text(json.dumps(rows, indent=2))


# ---- the real pair over HTTP -------------------------------------------------------------------------------------
def pair_setups(draft: str) -> dict[str, tuple[list[str], dict]]:
    """name -> (`specdec serve` options, request fields): target-only, ngram with τ at most 3, the 0.5B draft, the
    default, and the 0.5B with τ fixed too large."""
    return {"target-only": (["--draft", "none"], {}), "ngram tau<=3": (["--draft", "ngram", "--max-tau", "3"], {}),
            "0.5B": (["--draft", draft], {}), "default": ([], {}),
            "0.5B tau=8 fixed": (["--draft", draft], {"tau": 8, "policy": "fixed"})}


def fix_for(report: dict, options: list[str], extra: dict, draft: str) -> tuple[list[str], dict] | None:
    """The setup with the analyzer's suggested fix applied, or None where it names nothing to apply."""
    kind = report["bottleneck"]
    at = options.index("--draft") if "--draft" in options else None
    name = options[at + 1] if at is not None else "ngram"  # the default draft of a target without a datastore
    rest = options[:at] + options[at + 2:] if at is not None else list(options)
    if kind == "rare_proposals":  # the draft model chained behind the drafter that rarely proposes
        return rest + ["--draft", f"{name}+{draft}"], extra
    if kind in ("tau_too_large", "tau_too_small", "verify_cost"):
        best = report["speedup"]["best_tau"]
        return (options, {**extra, "tau": best, "policy": "fixed"}) if best else (rest + ["--draft", "none"], {})
    if kind == "draft_cost":
        return rest + ["--draft", "ngram"], extra
    if kind == "low_acceptance":
        return rest + ["--draft", "none"], {}
    return None


def serve_and_analyze(name: str, options: list[str], extra: dict, target, prompts, max_tokens: int, logs,
                      html: Path | None = None) -> dict:
    """One setup served and its traces analyzed; with `html`, its report is written there as `<setup>.html`, with a
    screenshot `<setup>.png` taken in headless Chromium."""
    import shutil
    import tempfile

    from browser import screenshot
    from pair import Server, request

    from specdec.analyze import analyze_many, load_traces
    trace_dir = Path(tempfile.mkdtemp(prefix="specdec-diagnosis-"))
    cmd = [str(Path(sys.executable).with_name("specdec")), "serve", "--target", str(target), "--host", "127.0.0.1",
           "--port", "PORT", "--trace-dir", str(trace_dir), *options]
    server = Server(name.replace(" ", "_").replace("/", "_"), cmd, logs)
    try:
        request(server, {"workload": "chat", "prompt": "Hi"}, 4)
        for f in trace_dir.glob("*.jsonl"):
            f.unlink()  # the warm-up's trace
        for p in prompts:
            request(server, p, max_tokens, extra)
    finally:
        server.stop()
    time.sleep(0.5)  # the worker writes a request's trace after its answer
    report = analyze_many(load_traces([str(trace_dir)]))
    if html is not None:
        page = html / (name.replace(" ", "_").replace("/", "_").replace("<=", "le").replace("=", "") + ".html")
        write_report({name: load_traces([str(trace_dir)])}, str(page))
        screenshot(page, page.with_suffix(".png"))  # (browser.py)
    shutil.rmtree(trace_dir, ignore_errors=True)
    return report


def pair_suite(args) -> int:
    from pair import PROMPTS as PAIR_PROMPTS, fetch_model
    target, draft = fetch_model("coder15"), fetch_model("coder05")
    prompts = [json.loads(line) for line in PAIR_PROMPTS.read_text().splitlines() if line.strip()]
    prompts = [p for w in ("completion", "chat", "edits") for p in [q for q in prompts if q["workload"] == w][:2]]
    logs = Path("/tmp/specdec-diagnosis-logs")
    logs.mkdir(exist_ok=True)
    rows, html = [], Path(args.html) if args.html else None
    if html is not None:
        html.mkdir(parents=True, exist_ok=True)
    setups = pair_setups(str(draft))
    for name in args.setups.split(",") if args.setups else []:
        if name not in setups:
            raise SystemExit(f"unknown setup {name!r} (choose from {', '.join(setups)})")
    for name, (options, extra) in setups.items():
        if args.setups and name not in args.setups.split(","):
            continue
        rep = serve_and_analyze(name, options, extra, target, prompts, args.max_new_tokens, logs, html)
        sp, s = rep["speedup"], rep["summary"]
        gains = {f["kind"]: f["speedup_if_fixed"] for f in rep["findings"] if f["speedup_if_fixed"]}
        row = {"setup": name, "options": options, "request": extra, "bottleneck": rep["bottleneck"], "measured": sp["measured"],
               "predicted": sp["predicted"], "prediction_error": sp["prediction_error"],
               "unexplained": sp["unexplained"], "tau": s["tau"], "proposal_rate": s["proposal_rate"],
               "shortfalls": s["shortfalls"], "acceptance": s["acceptance_rate"], "ceiling": sp["ceiling"],
               "gains": gains, "finding": next((f["finding"] for f in rep["findings"]
                                                if f["kind"] == rep["bottleneck"]), None)}
        fix = fix_for(rep, options, extra, str(draft)) if args.fix else None
        if fix is not None:
            again = serve_and_analyze(name + " fixed", *fix, target, prompts, args.max_new_tokens, logs)
            # a τ fix is a prediction from this trace; the others are ceilings (what removing the cause would give:
            # a draft model chained in, or a cheaper draft, has its own acceptance and cost)
            row.update(fix=fix, predicted_after_fix=gains.get(rep["bottleneck"]),
                       prediction_kind="prediction" if rep["bottleneck"].startswith("tau") else "ceiling",
                       measured_after_fix=again["speedup"]["measured"], bottleneck_after_fix=again["bottleneck"])
        rows.append(row)
        print(f"{name}: {row['bottleneck']} (measured {row['measured']}x, predicted {row['predicted']}x; proposal "
              f"rate {row['proposal_rate']}, shortfalls {row['shortfalls']})" +
              (f"; fix {fix}: predicted {row['predicted_after_fix']}x, measured {row['measured_after_fix']}x"
               if fix else ""), file=sys.stderr, flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps(rows, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).parent))
    sys.exit(main())
