"""Losslessness on the default model: every drafter x tau 1..8, greedy, token for token against target-only decoding
in the same numerics mode, over the shipped chat and code prompts. Prints one line per drafter and exits non-zero on
any difference.

    python benchmarks/runtime.py lossless [--numerics q8] [--max-new-tokens 48] [--limit 6] [--json out.json]
"""
from __future__ import annotations

import argparse
import json
import sys

from specdec import SpecDecoder, models
from specdec.prompts import HERE, load_prompts

DRAFTERS = ("ngram", "datastore", "recycle", "shipped", "target", "datastore+ngram", "datastore+ngram+recycle",
            "datastore+ngram+shipped")


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--numerics", default="q8", choices=["exact", "q8"])
    ap.add_argument("--max-new-tokens", type=int, default=48)
    ap.add_argument("--limit", type=int, default=6, help="prompts per set (chat, code)")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    model, tok = models.load("default", numerics=args.numerics)
    prompts = load_prompts(HERE / "chat.jsonl")[: args.limit] + load_prompts(HERE / "code.jsonl")[: args.limit]
    alone = SpecDecoder.from_models(model, tok, "none")
    want = [alone.generate(p["prompt"], max_new_tokens=args.max_new_tokens, chat=p["chat"]).token_ids for p in prompts]
    report, failures = {}, 0
    for draft in DRAFTERS:
        differ = []
        for tau in range(1, 9):
            dec = SpecDecoder.from_models(model, tok, draft, tau=tau)
            for p, w in zip(prompts, want):
                if dec.generate(p["prompt"], max_new_tokens=args.max_new_tokens, chat=p["chat"]).token_ids != w:
                    differ.append({"tau": tau, "prompt": p["prompt"][:40]})
        report[draft] = {"runs": 8 * len(prompts), "differ": differ}
        failures += len(differ)
        print(f"{draft}: {8 * len(prompts) - len(differ)}/{8 * len(prompts)} runs (tau 1..8 x {len(prompts)} prompts) "
              f"token-identical to {args.numerics} target-only", file=sys.stderr)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"numerics": args.numerics, "max_new_tokens": args.max_new_tokens, "drafters": report}, f,
                      indent=1)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
