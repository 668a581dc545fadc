"""Prefetch distances compared in one process, pass by pass: the model is loaded once and each verify pass of n rows
runs under every setting in turn (the order reversed every other round), so the bandwidth this shared machine swings
by within minutes hits each alike, and no second process or build differs. Reports per size the median ms under each
setting and the median of the paired ratios to the first. Prefetching changes no bit (tests/test_q8.py), so only the
time can differ.

    python benchmarks/runtime.py prefetch-ab --settings 8192,8192,0 8192,8192,16384 [--model FILE.gguf] [--rows 1,2,4,8]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from pathlib import Path
from time import perf_counter

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from specdec import kernels, models  # noqa: E402
from specdec.kv import cached_model  # noqa: E402


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--settings", nargs="+", required=True, help="ONE,MANY,L2 bytes each; the first is the base")
    ap.add_argument("--model", default=str(Path("~/.cache/specdec/pair/coder15.gguf").expanduser()))
    ap.add_argument("--rows", default="1,2,3,4,6,8")
    ap.add_argument("--pairs", type=int, default=30, help="rounds of every setting per size")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    try:
        settings = [tuple(int(v) for v in s.split(",")) for s in args.settings]
        if any(len(s) != 3 for s in settings):
            raise ValueError
    except ValueError:
        print("prefetch_ab: each setting is ONE,MANY,L2 bytes", file=sys.stderr)
        return 2
    lib = kernels.library()
    if lib is None:
        print("prefetch_ab: needs the CPU kernels", file=sys.stderr)
        return 2
    model = models.load(args.model, numerics="q8")[0]
    lm = cached_model(model, model.config.vocab_size)
    prompt = list(range(1, 65))
    lm.forward(prompt)
    sizes = [int(r) for r in args.rows.split(",")]
    times = {(s, n): [] for s in settings for n in sizes}
    for i in range(args.pairs + 1):  # round 0 warms up
        for n in sizes:
            for s in settings if i % 2 else settings[::-1]:
                lib.set_prefetch(*s)
                t = perf_counter()
                lm.forward(prompt + [7 + i % 50] * n, n)
                if i:
                    times[(s, n)].append((perf_counter() - t) * 1e3)
                lm.rollback(len(prompt))
    base = settings[0]
    report = {"model": Path(args.model).name, "cpu": kernels.cpuinfo("model name"), "pairs": args.pairs, "sizes": {}}
    print("| rows | " + " | ".join(f"{s} ms (ratio)" for s in settings) + " |")
    print("|---" * (len(settings) + 1) + "|")
    for n in sizes:
        row = {}
        for s in settings:
            ratio = statistics.median(b / a for a, b in zip(times[(base, n)], times[(s, n)]))
            row[",".join(map(str, s))] = {"ms": round(statistics.median(times[(s, n)]), 2), "ratio": round(ratio, 3)}
        report["sizes"][n] = row
        print(f"| {n} | " + " | ".join(f"{v['ms']} ({v['ratio']})" for v in row.values()) + " |")
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
