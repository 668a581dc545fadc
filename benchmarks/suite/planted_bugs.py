"""`specdec check` against planted sampling bugs on the default model: the real code must pass, each bug must fail.

    python benchmarks/serve.py planted-bugs --draft datastore+ngram --draft ngram --out docs/planted_bugs.json

Bugs (patched into this process only):
- resample_from_p: after a rejection, resample from p instead of norm(max(0, p - q));
- wrong_q: the draft reports a q other than the one it sampled from (uniform; for model-free drafters, whose q is
  one-hot, a uniform q instead of it).
"""
from __future__ import annotations

import argparse
import contextlib
import io
import json
import sys

import torch

import specdec.verification as verification
from specdec.cli import main as cli
from specdec.drafters import ModelDrafter, NgramDrafter
from specdec.drafters.datastore import DatastoreDrafter
from specdec.drafters.feature import FeatureDrafter


@contextlib.contextmanager
def planted(bug: str):
    saved = []
    if bug == "resample_from_p":
        saved.append((verification, "residual", verification.residual))
        verification.residual = lambda p, q: p
    elif bug == "wrong_q":
        for cls in (NgramDrafter, DatastoreDrafter, ModelDrafter, FeatureDrafter):
            original = cls.propose

            def wrong(self, context, k, params, generator, _original=original):
                d = _original(self, context, k, params, generator)
                if d.tokens:
                    vocab = self.vocab if hasattr(self, "vocab") else 49152
                    d.q = torch.full((len(d.tokens), vocab), 1.0 / vocab, dtype=torch.float64)
                return d
            saved.append((cls, "propose", original))
            cls.propose = wrong
    try:
        yield
    finally:
        for owner, name, value in saved:
            setattr(owner, name, value)


def run(draft: str, bug: str, extra: list[str]) -> dict:
    out = io.StringIO()
    with planted(bug), contextlib.redirect_stdout(out):
        code = cli(["check", "--draft", draft, "--limit", "6", "--max-new-tokens", "4", "--json", *extra])
    rep = json.loads(out.getvalue())
    return {"draft": draft, "bug": bug, "exit": code, "passed": rep["passed"],
            "sampling": [{k: r.get(k) for k in ("draft", "verdict", "p_value", "events", "samples", "detectable_tv")}
                         for r in rep.get("sampling", [])]}


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--draft", action="append", default=None)
    ap.add_argument("--bug", action="append", default=None, help="none, resample_from_p, wrong_q (default: all)")
    ap.add_argument("--out", default=None)
    ap.add_argument("extra", nargs="*", help="more `specdec check` arguments")
    args = ap.parse_args()
    rows = []
    for draft in args.draft or ["datastore+ngram", "ngram"]:
        for bug in args.bug or ("none", "resample_from_p", "wrong_q"):
            rows.append(run(draft, bug, args.extra))
            print(json.dumps(rows[-1]), file=sys.stderr)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(rows, f, indent=2)


if __name__ == "__main__":
    main()
