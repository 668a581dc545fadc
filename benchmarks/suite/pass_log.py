"""Where a server's time went, pass by pass: the log `specdec serve --pass-log FILE` writes, grouped by what each
pass carried, its drafts priced on the curve the server priced them with (specdec/batch/pass_log.py).

    python benchmarks/serve.py pass-log FILE [FILE ...] [--baseline-ms 0.9]

Per file: passes, total seconds (pass + outside it), and per group (no drafts; chains or trees, where at most 4 or
more requests decoded; with prompt chunks or not): passes, draft rows, accepted, the pass's time over its price, ms
a pass outside the pass, and the drafts' net saving in seconds; then per load (decoding requests 1, 2-3, 4-7, 8+):
tokens a second of the server's time and the load's share of the tokens. `--baseline-ms`: target-only's own ms a pass outside
the pass (its log says: its `none` group's), charged to no draft.
"""
from __future__ import annotations

import argparse
import statistics
import sys
from collections import defaultdict

from specdec.batch.pass_log import FIELDS, by_load, read, summary
from specdec.costs import interpolate


def curve_of(records: list[dict]) -> dict[int, float]:
    """The curve the server priced with, as its passes read it: the median price by rows."""
    by = defaultdict(list)
    for r in records:
        if r.get("priced_ms") is not None:
            by[r["rows"]].append(r["priced_ms"])
    return {n: statistics.median(v) for n, v in sorted(by.items())}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("files", nargs="+")
    ap.add_argument("--baseline-ms", type=float, default=None,
                    help="target-only's ms a pass outside the pass (default: the first file's `none` group's)")
    args = ap.parse_args(argv)
    baseline = args.baseline_ms
    for path in args.files:
        try:
            records = read(path)
            lacking = next((f for r in records for f in FIELDS if not isinstance(r, dict) or f not in r), None)
            if lacking is not None:
                raise ValueError(f"a line without {lacking!r}")
        except (OSError, ValueError) as e:  # (a missing file, or not a pass log: one line, not a traceback)
            print(f"pass-log: {path}: {e.strerror if isinstance(e, OSError) else 'not a pass log (' + str(e) + ')'}",
                  file=sys.stderr)
            return 2
        if not records:
            print(f"{path}: no passes")
            continue
        curve = curve_of(records)
        groups = summary(records, lambda rows: interpolate(curve, round(rows)), baseline or 0.0)
        if baseline is None and "none" in groups:
            baseline = groups["none"]["outside_ms"]
            groups = summary(records, lambda rows: interpolate(curve, round(rows)), baseline)
        total = sum(r["verify_ms"] + r["before_ms"] + r["after_ms"] for r in records) / 1e3
        print(f"{path}: {len(records)} passes, {total:.1f} s (outside the passes: {baseline or 0:.2f} ms a pass "
              "charged to no draft)")
        print("| group | passes | draft rows | accepted | pass / price | ms outside | drafts saved, s |")
        print("|---|---|---|---|---|---|---|")
        for name, g in groups.items():
            print(f"| {name} | {g['passes']} | {g['draft_rows']} | {g['accepted']} | {g['verify_over_priced']} "
                  f"| {g['outside_ms']} | {g['saved_ms'] / 1e3:.2f} |")
        print("\n| decoding requests | passes | tokens | s | tokens/s | share of the tokens |\n|---|---|---|---|---|---|")
        for load, g in by_load(records).items():
            print(f"| {load} | {g['passes']} | {g['tokens']} | {g['s']} | {g['tokens_per_s']} | {g['share']:.0%} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
