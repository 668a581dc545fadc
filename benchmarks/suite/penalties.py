"""What penalties (and a grammar) cost speculation: target-only and a draft, in one process, without penalties and
with each of the given settings, the systems alternated prompt by prompt. Reports decode tokens/s, the speed-up over
target-only under the same setting, and drafts accepted of proposed. `--batch`: each request through the batch engine (the
server's path, one request at a time) instead of the single-request engine.

    python benchmarks/serve.py penalties [--target default] [--draft datastore+ngram] [--max-new-tokens 64] [--rounds 3]
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from time import perf_counter

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from specdec import SpecDecoder  # noqa: E402

PROMPTS = ["List the numbers from 1 to 12.", "Write a Python function that returns the first n square numbers.",
           "Explain what a cache is."]
SETTINGS = {"none": {}, "frequency 0.5": {"frequency_penalty": 0.5}, "presence 0.5": {"presence_penalty": 0.5},
            "repetition 1.3": {"repetition_penalty": 1.3}, "json_object": {"response_format": {"type": "json_object"}}}


class Batched:
    """One request at a time through a BatchEngine on the decoder's target and drafter: generate() as SpecDecoder's,
    returning what the report reads."""

    def __init__(self, sd):
        from specdec.batch import BatchEngine
        self.sd = sd
        self.engine = BatchEngine(sd.model, sd.engine.drafter, sd.model.config.vocab_size, sd.engine.eos_ids,
                                  sd.context_window)

    def generate(self, prompt, max_new_tokens, **kw):
        from types import SimpleNamespace
        from specdec.batch import Sequence
        req = self.sd.prepare(prompt, max_new_tokens=max_new_tokens, **kw)
        seq = self.engine.add(Sequence(req.prompt_ids, max_new_tokens, req.params, constraint=req.constraint))
        accepted = proposed = 0
        while self.engine.running:
            for _, rec in self.engine.step():
                if rec is not None:
                    accepted, proposed = accepted + rec.accepted, proposed + len(rec.proposed)
        return SimpleNamespace(token_ids=seq.generated, stats={"accepted": accepted, "proposed": proposed})


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--target", default="default")
    ap.add_argument("--draft", default="datastore+ngram")
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--batch", action="store_true", help="through the batch engine (the server's path)")
    ap.add_argument("--settings", default=",".join(SETTINGS), help="comma-separated, of: " + ", ".join(SETTINGS))
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    base = SpecDecoder(target=args.target, draft="none")
    systems = {"target-only": base, args.draft: SpecDecoder.from_models(base.model, base.tokenizer, args.draft)}
    if args.batch:
        systems = {name: Batched(sd) for name, sd in systems.items()}
    report = {}
    chosen = args.settings.split(",")
    if any(label not in SETTINGS for label in chosen):
        ap.error(f"--settings: each of {', '.join(SETTINGS)}")
    for label, kw in ((label, SETTINGS[label]) for label in chosen):
        tally = {name: [0, 0.0, 0, 0] for name in systems}  # tokens, seconds, accepted, proposed
        for sd in systems.values():
            sd.generate(PROMPTS[0], max_new_tokens=8, **kw)  # warm: a drafter's first use loads what it needs
        for r in range(args.rounds):
            for p in PROMPTS:
                for name in (list(systems) if r % 2 == 0 else list(systems)[::-1]):
                    t = perf_counter()
                    out = systems[name].generate(p, max_new_tokens=args.max_new_tokens, **kw)
                    row = tally[name]
                    row[0] += len(out.token_ids)
                    row[1] += perf_counter() - t
                    row[2] += out.stats["accepted"]
                    row[3] += out.stats["proposed"]
        speeds = {name: row[0] / row[1] for name, row in tally.items()}
        report[label] = {name: {"tokens_per_s": round(speeds[name], 1),
                                "speedup": round(speeds[name] / speeds["target-only"], 3),
                                "accepted": row[2], "proposed": row[3]} for name, row in tally.items()}
        d = report[label][args.draft]
        print(f"{label:15s} target-only {speeds['target-only']:6.1f} tok/s | {args.draft} {d['tokens_per_s']:6.1f} "
              f"tok/s ({d['speedup']:.2f}x), accepted {d['accepted']}/{d['proposed']}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"target": args.target, "draft": args.draft, "batch": args.batch,
                       "max_new_tokens": args.max_new_tokens,
                       "rounds": args.rounds, "settings": SETTINGS, "results": report}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
