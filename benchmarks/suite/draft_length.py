"""Where a model draft's chain should stop: the pair's 0.5B, teacher-forced on the 1.5B's own greedy answers to the
pair's prompts, then simulated on a pass curve (no timing: the machine's drift does not enter).

    python benchmarks/draft.py length --out docs/draft_length.json

For each answer position the draft's argmax, whether it is the target's token, and its softmax probability come from
one draft pass over prompt + answer: a greedy chain that is still accepted has fed exactly the target's tokens, so
these are the chain's own steps, and a second choice that is the target's token continues along the answer. A cycle at position s drafts up to τ tokens, stopping after a token once the product
of the drafted tokens' probabilities falls below the threshold (0: never), and keeps the accepted prefix plus the target's token. Its cost, in one-row target passes: drafted × the draft's step
+ the verify pass of drafted + 1 rows (the curve) + a cycle's overhead. The speed-up is target-only's cost per token
(1 + overhead) over that.

The rule was built and measured on the server, and not kept: its gain over fixed τ here is a gain over a baseline
the server does not run (its scheduler already sizes τ per request), CHANGELOG.md, "Dynamic draft length for a model draft".
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

HERE = Path(__file__).parent
sys.path.insert(0, str(HERE.parent))
CURVE_FILE = HERE.parent / "docs" / "pair_curve_amd2.json"  # the 1.5B's q8 pass curve (pair_curve.py), this EPYC
STEP = 0.28  # the 0.5B's step against a one-row 1.5B pass (docs/pair_draft_cache_vs_previous2.json: 8.8 / 31.2 ms)
OVERHEAD = 0.03
WORKLOADS = ("completion", "chat", "edits")


def teacher_forced(target: str, draft: str) -> list[dict]:
    import torch

    from specdec.api import SpecDecoder
    from specdec.drafters.registry import _four_bit
    from specdec.runtime.load import load_gguf
    os.environ["HF_HUB_OFFLINE"] = "1"
    sd = SpecDecoder(target=target, draft="none")
    d = load_gguf(_four_bit(Path(draft)), max_len=4096)
    d.set_numerics("q8")
    out = []
    for line in open(HERE / "pair_prompts.jsonl"):
        p = json.loads(line)
        if p["workload"] not in WORKLOADS:
            continue
        chat = p["workload"] != "completion"  # as pair.py sends them
        prompt = [{"role": "user", "content": p["prompt"]}] if chat else p["prompt"]
        ids = sd.encode(prompt, chat=chat)
        answer = sd.generate(prompt, max_new_tokens=128, chat=chat).token_ids
        cache = d.new_cache()
        cache.forward(ids[:-1])
        probs = cache.forward(ids + answer[:-1], n_logits=len(answer)).float().softmax(-1)
        top = probs.topk(2, -1)
        out.append({"workload": p["workload"], "p": top.values[:, 0].tolist(),
                    "match": [int(a == b) for a, b in zip(top.indices[:, 0].tolist(), answer)],
                    "second": [int(a == b) for a, b in zip(top.indices[:, 1].tolist(), answer)]})
        print(f"draft_length: {p['workload']} {len(answer)} tokens, {sum(out[-1]['match']) / len(answer):.2f} agree",
              file=sys.stderr)
    return out


def simulate(answers: list[dict], curve: list[float], tau: int, threshold: float = 0.0,
             siblings: int = 0) -> tuple[float, float]:
    """-> (speed-up over target-only, tokens a pass) over the answers. `siblings`: a tree, the chain plus the draft's
    second choice beside each of its first `siblings` tokens (from the same draft steps: only verify rows cost)."""
    tokens = cost = passes = 0
    for a in answers:
        match, second, p, s, n = a["match"], a["second"], a["p"], 0, len(a["match"])
        while s < n:
            reach, k = 1.0, 0
            while k < tau and s + k < n and (k == 0 or reach >= threshold):
                reach *= p[s + k]
                k += 1
            accepted = 0
            while accepted < k and match[s + accepted]:
                accepted += 1
            rows = k + min(siblings, k) + 1
            if accepted < min(siblings, k) and second[s + accepted]:
                accepted += 1  # the sibling, then the target's own token
            cost += k * STEP + curve[min(rows, len(curve)) - 1] + OVERHEAD
            passes += 1
            s += accepted + 1
        tokens += n
    return tokens * (1 + OVERHEAD) / cost, tokens / passes


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    cache = Path(os.environ.get("SPECDEC_CACHE", Path.home() / ".cache" / "specdec")) / "pair"
    ap.add_argument("--target", default=str(cache / "coder15.gguf"))
    ap.add_argument("--draft", default=str(cache / "coder05.gguf"))
    ap.add_argument("--curve", type=Path, default=CURVE_FILE, help="a pass curve JSON from pair_curve.py")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    ratios = json.loads(args.curve.read_text())["ratio_to_one_row"]["q8"]
    curve = [ratios[str(n)] for n in range(1, len(ratios) + 1)]
    answers = teacher_forced(args.target, args.draft)
    table = {}
    for w in WORKLOADS:
        mine = [a for a in answers if a["workload"] == w]
        fixed = {tau: simulate(mine, curve, tau) for tau in range(1, 9)}
        best = max(fixed, key=lambda t: fixed[t][0])
        row = {"fixed": {"tau": best, "speedup": round(fixed[best][0], 3), "tokens_per_pass": round(fixed[best][1], 2)}}
        for threshold in (0.4, 0.5, 0.6, 0.7):
            for tau in (4, 6, 8):
                speed, per_pass = simulate(mine, curve, tau, threshold)
                row[f"{threshold}/{tau}"] = {"speedup": round(speed, 3), "tokens_per_pass": round(per_pass, 2)}
        trees = {(tau, sib): simulate(mine, curve, tau, siblings=sib) for tau in range(1, 9) for sib in (1, 2, 3)}
        tau, sib = max(trees, key=lambda t: trees[t][0])
        row["siblings"] = {"tau": tau, "siblings": sib, "speedup": round(trees[tau, sib][0], 3),
                           "tokens_per_pass": round(trees[tau, sib][1], 2)}
        table[w] = row
        print(f"{w:10s} best fixed τ={best}: {fixed[best][0]:.3f}x  " + "  ".join(
            f"{k} {v['speedup']:.3f}x" for k, v in row.items() if k not in ("fixed", "siblings")))
        print(f"{'':10s} best tree, τ={tau} with {sib} siblings: {trees[tau, sib][0]:.3f}x")
    if args.out:
        args.out.write_text(json.dumps({"step": STEP, "curve": args.curve.name, "overhead": OVERHEAD, "table": table},
                                       indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
