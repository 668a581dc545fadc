"""How fast could speculation be on this machine? Upper bounds on each workload's speed-up over target-only, from
a measured pass curve and the target's own answers, beside what a pair run measured.

    python benchmarks/pair.py bounds --results docs/pair.json --curve docs/pair_curve.json
    python benchmarks/pair.py bounds --results docs/pair.json --curve docs/pair_curve_xeon.json --draft-step 0.2

For each prompt, the target-only answer (`ours-none` in the results, its text tokenized again) is cut into passes
of 1 + k tokens, a pass of r rows costing curve(r) one-row passes (pair_curve.py's q8 ratios; at most 16 rows a
pass). A dynamic program finds the cheapest cut for each kind of draft; the bound is tokens / cost:
- oracle: a free draft that is always right (any k up to 15);
- copy: a free draft that proposes exactly the next stretch of the answer that occurs, MIN_RUN tokens or more, in
  what the request carries (an edit's quoted function, which the edits-predicted workload also sends as its
  prediction; the prompt otherwise), aligned by an oracle; nothing elsewhere;
- copy+model: the copy, and elsewhere a model draft that is always right and costs `--draft-step` of a one-row pass
  per drafted token (the 0.5B's step is about 0.2 of the 1.5B's one-row pass on the EPYC, docs/pair.md);
- copy+model at alpha: the same model right with probability alpha per token, independently, its chains sized for
  the best rate. alpha is what reproduces `--alpha-system`'s measured run on each workload (its accepted drafts a
  pass at its proposed drafts a pass, per_token_alpha): accepted / proposed alone understates it, since every draft
  after a rejection counts as proposed.
Prefill, sampling and the loop's own time are left out, so every bound is above what any drafter can reach.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from pair import PROMPTS, fenced, fetch_model  # noqa: E402

MAX_ROWS = 16  # pair_curve.py measures 1..16 rows
MIN_RUN = 3  # a copy shorter than this is a coincidence a drafter cannot find (drafters/prediction.py MIN_REJOIN)
GOALS = {"completion": 1.5, "chat": 1.5, "edits": 2.5, "fim": 1.5, "chat-sampled": 1.3, "edits-predicted": 4.0}


def cheapest(n: int, copy: list[int], curve: dict[int, float], token_cost: float | None = None,
             plain: float | None = None) -> float:
    """The least cost (in one-row passes) to emit n tokens. A pass at i emits k drafts and the target's own token:
    the first min(k, copy[i]) drafts are copied for free, the rest come from a model at token_cost each (None: no
    model). `plain`: what a token costs where nothing is drafted (default a one-row pass; a fallible model's
    expected cost per token, model_rate)."""
    best = [0.0] * (n + 1)
    for i in range(n - 1, -1, -1):
        options = [(curve[1] if plain is None else plain) + best[i + 1]]
        for k in range(1, min(MAX_ROWS - 1, n - 1 - i) + 1):
            model = max(0, k - copy[i])
            if model and token_cost is None:
                break
            options.append(curve[k + 1] + model * (token_cost or 0.0) + best[i + k + 1])
        best[i] = min(options)
    return best[0]


def copy_runs(answer: list[int], source: list[int]) -> list[int]:
    """For each answer position, how many tokens from it on occur together in the source (0 under MIN_RUN)."""
    starts: dict[int, list[int]] = {}
    for j, t in enumerate(source):
        starts.setdefault(t, []).append(j)
    runs = []
    for i in range(len(answer)):
        longest = 0
        for j in starts.get(answer[i], []):
            m = 0
            while i + m < len(answer) and j + m < len(source) and answer[i + m] == source[j + m]:
                m += 1
            longest = max(longest, m)
        runs.append(longest if longest >= MIN_RUN else 0)
    return runs


def per_token_alpha(acceptance: float, tokens_per_pass: float) -> float:
    """The alpha of independent drafts that accepts tokens_per_pass - 1 drafts a pass from chains of the measured
    proposed length (accepted / acceptance; a fractional length: its last draft proposed that share of the time)."""
    accepted = tokens_per_pass - 1
    length = accepted / acceptance if acceptance > 0 else 0.0
    if accepted <= 0 or length <= 0:
        return 0.0

    def expected(a: float) -> float:
        whole = int(length)
        return sum(a ** k for k in range(1, whole + 1)) + (length - whole) * a ** (whole + 1)
    lo, hi = 0.0, 1.0
    for _ in range(60):  # expected() rises with a
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if expected(mid) < accepted else (lo, mid)
    return round(lo, 4)


def model_rate(alpha: float, step: float, curve: dict[int, float]) -> float:
    """Cost per emitted token of a model draft right with probability alpha per token, at its best chain length."""
    def cost_per_token(k: int) -> float:
        tokens = sum(alpha ** j for j in range(k + 1))
        return (curve[k + 1] + k * step) / tokens
    return min(cost_per_token(k) for k in range(MAX_ROWS))


def read_json(path: str) -> dict:
    try:
        out = json.loads(Path(path).read_text())
    except (OSError, ValueError) as e:
        raise SystemExit(f"{path}: cannot read it as JSON ({e.__class__.__name__})") from None
    if not isinstance(out, dict):
        raise SystemExit(f"{path}: not a JSON object")
    return out


def load_curve(path: str) -> dict[int, float]:
    ratios = read_json(path).get("ratio_to_one_row", {}).get("q8")
    if not isinstance(ratios, dict):
        raise SystemExit(f"{path}: no q8 ratio_to_one_row (a pair_curve.py JSON is needed)")
    curve = {int(k): float(v) for k, v in ratios.items()}
    missing = [r for r in range(1, MAX_ROWS + 1) if r not in curve]
    if missing:
        raise SystemExit(f"{path}: the q8 curve lacks {missing[0]} rows (pair_curve.py measures 1..{MAX_ROWS})")
    return curve


def sources(prompt: dict) -> list[str]:
    """What a request carries that its answer may copy."""
    if prompt["workload"].startswith("edits"):
        return [fenced(prompt["prompt"])]
    return [prompt["prompt"], prompt.get("suffix", "")]


def bounds(results: dict, curve: dict[int, float], tokenizer, step: float, alpha_system: str,
           alpha_all: float | None = None) -> dict:
    prompts = [json.loads(line) for line in PROMPTS.read_text().splitlines() if line.strip()]
    by_workload = {w: [p for p in prompts if p["workload"] == w.removesuffix("-predicted").removesuffix("-sampled")]
                   for w in GOALS}
    measured = results["systems"]
    report = {}
    for w, ps in by_workload.items():
        answers = sorted((r for r in results["results"].get("ours-none", []) if r["workload"] == w),
                         key=lambda r: r["i"])
        if not answers:
            continue
        repeat = max(1, len(answers) // len(ps))
        run = measured.get(alpha_system, {}).get(w) or {}
        alpha = alpha_all or (per_token_alpha(run["acceptance"], run["tokens_per_pass"])
                              if run.get("acceptance") and run.get("tokens_per_pass") else None)
        rows = []
        for j, r in enumerate(answers[::repeat]):
            answer = tokenizer.encode(r["text"])
            n = len(answer)
            source = [t for text in sources(ps[j]) for t in tokenizer.encode(text) + [-1]]
            copy = copy_runs(answer, source)
            row = {"tokens": n, "copied": round(sum(1 for c in copy if c) / n, 2),
                   "oracle": n / cheapest(n, [MAX_ROWS] * n, curve),
                   "copy": n / cheapest(n, copy, curve),
                   "copy+model": n / cheapest(n, copy, curve, step)}
            if alpha:  # a model right alpha of the time: where nothing is copied a token costs its expected rate
                row["copy+model@alpha"] = n / cheapest(n, copy, curve, plain=model_rate(alpha, step, curve))
            rows.append(row)
        geo = {k: round(statistics.geometric_mean([x[k] for x in rows]), 2) for k in rows[0]
               if k not in ("tokens", "copied")}
        geo["copied"] = round(statistics.mean(x["copied"] for x in rows), 2)
        best = max((s.get(w, {}).get("vs_target_only", {}).get("geomean", 0), name) for name, s in measured.items()
                   if not name.startswith(("llama", "prev")))
        report[w] = {"goal": GOALS[w], **geo, "alpha": alpha, "measured_best": best[0], "best_system": best[1],
                     "prompts": rows}
    return report


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--results", required=True, help="a pair.py JSON with ours-none among its systems")
    ap.add_argument("--curve", required=True, help="a pair_curve.py JSON")
    ap.add_argument("--draft-step", type=float, default=0.2, help="a model draft's step, in one-row target passes")
    ap.add_argument("--alpha-system", default="ours-0.5b", help="whose measured acceptance the model bound takes")
    ap.add_argument("--alpha", type=float, default=None, help="that acceptance for every workload instead")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    from specdec.models import _gguf_tokenizer
    results = read_json(args.results)
    if "ours-none" not in results.get("results", {}):
        raise SystemExit(f"{args.results}: no ours-none answers (run pair.py with --systems ours-none,...)")
    tokenizer = _gguf_tokenizer(fetch_model("coder15"))
    report = bounds(results, load_curve(args.curve), tokenizer, args.draft_step, args.alpha_system,
                    args.alpha)
    cols = ("goal", "oracle", "copy", "copy+model", "copy+model@alpha", "measured_best")
    print(f"{'workload':16s} " + " ".join(f"{c:>16s}" for c in cols) + "  copied")
    for w, r in report.items():
        print(f"{w:16s} " + " ".join(f"{r.get(c) or '-':>16}" for c in cols) + f"  {r['copied']}")
    if args.out:
        Path(args.out).write_text(json.dumps({"results": args.results, "curve": args.curve,
                                              "draft_step": args.draft_step, "min_run": MIN_RUN,
                                              "alpha": args.alpha or args.alpha_system,
                                              "workloads": report}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
