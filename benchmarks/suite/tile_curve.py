"""q8 passes of the same rows in each tiling the kernels have, in ONE process on one model: 8-row VNNI tiles, wide
VNNI tiles of 9..16 rows, and AMX tiles where the CPU has them. The arms alternate pass by pass (`rows_wide` and
`rows_amx` switch the kernels between passes), so the machine's drift hits all alike. Every pass also checks that
every arm gives the same logits, bitwise.

    python benchmarks/runtime.py tile-curve [--model default|pair|FILE.gguf] [--rows 1,8,9,10,12,16,17,24,40] [--reps 7]
        [--json out.json]
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
from specdec.kv import cached_model  # noqa: E402


def model_path(name: str) -> str:
    if name == "default":
        return str(models.default_model_path())
    if name == "pair":
        sys.path.insert(0, str(Path(__file__).parent))
        from pair import fetch_model
        return str(fetch_model("coder15"))
    return name


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="pair")
    ap.add_argument("--rows", default="1,8,9,10,12,16,17,24,40")
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    lib = kernels.library()
    if lib is None:
        raise SystemExit("tile_curve: no q8 kernels here")
    tilings = lib.tilings()
    sizes = [int(s) for s in args.rows.split(",")]
    model = models.load(model_path(args.model), numerics="q8")[0]
    lm = cached_model(model, model.config.vocab_size)
    prompt = list(range(1, 65))
    lm.forward(prompt)
    g = torch.Generator().manual_seed(0)
    ms = {(a, n): [] for a in tilings for n in sizes}
    try:
        for rep in range(args.reps + 1):  # the first round warms up
            for n in sizes:
                extra = torch.randint(0, 1000, (n,), generator=g).tolist()
                got = {}
                for arm, (amx, wide) in tilings.items():
                    lib.rows_amx(amx), lib.rows_wide(wide)
                    t0 = perf_counter()
                    got[arm] = lm.forward(prompt + extra, n)
                    if rep:
                        ms[arm, n].append((perf_counter() - t0) * 1e3)
                    lm.rollback(len(prompt))
                if any(not torch.equal(got["8-row"], v) for v in got.values()):
                    raise SystemExit(f"tile_curve: {n} rows differ between the tilings")
    finally:
        lib.rows_amx(lib.amx_rows), lib.rows_wide(lib.wide)
    curves = {arm: {n: round(median(ms[arm, n]), 2) for n in sizes} for arm in tilings}
    print("| rows | " + " | ".join(map(str, sizes)) + " |\n|---" + "|---" * len(sizes) + "|")
    for arm, c in curves.items():
        print(f"| {arm} ms | " + " | ".join(f"{c[n]:.1f}" for n in sizes) + " |")
    for arm in tilings:
        if arm != "8-row":
            print(f"| {arm} / 8-row | " + " | ".join(f"{curves[arm][n] / curves['8-row'][n]:.3f}" for n in sizes) + " |")
    if args.json:
        Path(args.json).write_text(json.dumps({"model": args.model, "reps": args.reps, "cpu": kernels.cpuinfo("model name"),
                                               "ms": curves, "identical": True}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
