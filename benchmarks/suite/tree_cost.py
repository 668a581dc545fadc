"""What a tree row costs beside a chain row, in ONE process on one model: S streams (KV slots at contexts near
--context), each given 1 + k rows a pass, as a chain (positions L..L+k) or as a tree (one row, then k siblings under
it, all at depth 1), the two alternated pass by pass so the machine's drift hits both alike. The rows, their slots and
their count are the same; only the attention differs (a tree row reads its path through a map). Every pass also checks
that the first row of each stream, the same in both, gives the same logits bitwise.

    python benchmarks/runtime.py tree-cost [--model default|pair|FILE.gguf] [--streams 8] [--siblings 1,3,7]
        [--context 300] [--reps 9] [--json out.json]
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from statistics import median
from time import perf_counter

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402

from specdec import kernels, models  # noqa: E402
from tile_curve import model_path  # noqa: E402


def rows(lens: list[int], slots: list[int], k: int, tree: bool):
    """One pass's tokens, slots, positions and paths (None for a chain pass)."""
    toks, sl, pos, paths = [], [], [], []
    for s, L in zip(slots, lens):
        for d in range(1 + k):
            toks.append(500 + d)
            sl.append(s)
            pos.append(L + (d > 0 if tree else d))
            paths.append(None if d == 0 else [L, L + d])  # a sibling stored at L + d, its parent at L
    return toks, sl, pos, (paths if tree else None)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="pair")
    ap.add_argument("--streams", type=int, default=8)
    ap.add_argument("--siblings", default="1,3,7")
    ap.add_argument("--context", type=int, default=300)
    ap.add_argument("--reps", type=int, default=9)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    model = models.load(model_path(args.model), numerics="q8")[0]
    slots = [model.acquire_slot() for _ in range(args.streams)]
    lens = [args.context + 7 * i for i in range(args.streams)]  # blocks of 16 end at different offsets
    for s, L in zip(slots, lens):
        model.forward([(13 * j + s) % 5000 + 100 for j in range(L)], [s] * L, list(range(L)), logit_rows=[])
    sizes = [int(k) for k in args.siblings.split(",")]
    ms = {(arm, k): [] for arm in ("chain", "tree") for k in sizes}
    for rep in range(args.reps + 1):  # the first round warms up
        for k in sizes:
            first = {}
            for arm in ("chain", "tree") if rep % 2 else ("tree", "chain"):
                toks, sl, pos, paths = rows(lens, slots, k, arm == "tree")
                t0 = perf_counter()
                out = model.forward(toks, sl, pos, paths=paths)
                if rep:
                    ms[arm, k].append((perf_counter() - t0) * 1e3)
                first[arm] = out[:: 1 + k]
            if not torch.equal(first["chain"], first["tree"]):
                raise SystemExit(f"tree_cost: a stream's first row differs between a chain and a tree pass ({k})")
    table = {k: {arm: round(median(ms[arm, k]), 2) for arm in ("chain", "tree")} for k in sizes}
    print(f"{kernels.cpuinfo('model name')}, {args.streams} streams at context ~{args.context}, median of {args.reps}")
    print("| rows a pass | chain ms | tree ms | tree - chain, ms a tree row |\n|---|---|---|---|")
    for k, t in table.items():
        print(f"| {args.streams * (1 + k)} | {t['chain']:.1f} | {t['tree']:.1f} | "
              f"{(t['tree'] - t['chain']) / (args.streams * k):.3f} |")
    if args.json:
        Path(args.json).write_text(json.dumps({"model": args.model, "streams": args.streams, "context": args.context,
                                               "reps": args.reps, "cpu": kernels.cpuinfo("model name"),
                                               "ms": table}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
