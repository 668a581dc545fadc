"""Cost per token of stop strings and detokenization along a 1,000-token output: the first 200 tokens against the
last 200, specdec's incremental text (specdec/text.py) against decoding the whole output every cycle (the previous
release's way), on the default model's tokenizer, one token per cycle as in target-only decoding.

    python benchmarks/stop_cost.py [--tokens 1000] [--json out.json]
"""
from __future__ import annotations

import argparse
import json
import time

from specdec import models, text
from specdec.prompts import load_prompts


def whole_output(tok, stops):
    """Decode everything each cycle; on a hit, decode every prefix to find where it completed."""
    def first(t):
        hits = [i for i in (t.find(s) for s in stops) if i >= 0]
        return min(hits) if hits else None

    def cycle(ids):
        t = tok.decode(ids, skip_special_tokens=True)
        if first(t) is not None:
            return next(m for m in range(1, len(ids) + 1) if first(tok.decode(ids[:m], skip_special_tokens=True)))
        return t
    return cycle


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=1000)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    _, tok = models.load("default")
    source = " ".join(p["prompt"] for p in load_prompts(None) * 20)
    ids = tok(source, add_special_tokens=False).input_ids[: args.tokens]
    stops = ["<never-1>", "<never-2>", "\n\n\n\n\n", "NEVER SAID"]  # four stops that never match: every cycle looks

    def time_per_token(step):
        out = []
        for n in range(1, len(ids) + 1):
            t0 = time.perf_counter()
            step(ids[:n])
            out.append((time.perf_counter() - t0) * 1e6)
        return out

    st = text.StopText(tok, stops)
    incremental = time_per_token(lambda x: (st.stop_check(x), st.visible(x, final=False)))
    old = time_per_token(whole_output(tok, stops))
    rep = {"tokens": len(ids), "stops": len(stops)}
    for name, t in (("incremental", incremental), ("whole_output", old)):
        first, last = sum(t[:200]) / 200, sum(t[-200:]) / 200
        rep[name] = {"first_200_us_per_token": round(first, 1), "last_200_us_per_token": round(last, 1),
                     "last_over_first": round(last / first, 2)}
    print(json.dumps(rep, indent=1))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rep, f, indent=1)


if __name__ == "__main__":
    main()
