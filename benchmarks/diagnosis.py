"""`specdec analyze` on real traces of the default model: each setup generates with --trace (fixed τ), the
analyzer reads the trace, and target-only runs of the same prompts, interleaved, give the actual speedup the
analyzer's measured one should agree with.

    python benchmarks/diagnosis.py --out docs/diagnosis.json
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

SETUPS = [("target", 6), ("shipped", 8), ("ngram", 6), ("datastore+ngram", 3)]
PROMPTS = ["Explain how a hash table works.", "Write a Python function that checks whether a string is a palindrome.",
           "What are three tips for writing clear emails?"]


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--max-new-tokens", type=int, default=48)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
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


if __name__ == "__main__":
    main()
