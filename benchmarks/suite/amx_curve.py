"""q8 passes with AMX tiles against the same passes on VNNI alone, in ONE process on one model: the arms alternate
pass by pass (`rows_amx` switches the kernels between passes), so the machine's drift hits both alike. Every pass
also checks that both arms give the same logits, bitwise. Needs a CPU with AMX-INT8 (Sapphire Rapids or later).

    python benchmarks/runtime.py amx-curve [--model default|pair|FILE.gguf] [--rows 1,8,12,16,24,40] [--reps 7] [--json out.json]
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
    ap.add_argument("--rows", default="1,8,12,16,24,40")
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    lib = kernels.library()
    if lib is None or lib.rows_amx(kernels.AMX_ROWS) == 0:
        raise SystemExit("amx_curve: no AMX-INT8 here (or the OS refuses its tile state)")
    sizes = [int(s) for s in args.rows.split(",")]
    model = models.load(model_path(args.model), numerics="q8")[0]
    lm = cached_model(model, model.config.vocab_size)
    prompt = list(range(1, 65))
    lm.forward(prompt)
    g = torch.Generator().manual_seed(0)
    arms = {"vnni": 0, "amx": kernels.AMX_ROWS}
    ms = {(a, n): [] for a in arms for n in sizes}
    for rep in range(args.reps + 1):  # the first round warms up
        for n in sizes:
            extra = torch.randint(0, 1000, (n,), generator=g).tolist()
            got = {}
            for arm, rows in arms.items():
                lib.rows_amx(rows)
                t0 = perf_counter()
                got[arm] = lm.forward(prompt + extra, n)
                if rep:
                    ms[arm, n].append((perf_counter() - t0) * 1e3)
                lm.rollback(len(prompt))
            if not torch.equal(got["vnni"], got["amx"]):
                raise SystemExit(f"amx_curve: {n} rows differ between AMX and VNNI")
    lib.rows_amx(lib.amx_rows)
    curves = {arm: {n: round(median(ms[arm, n]), 2) for n in sizes} for arm in arms}
    print("| rows | " + " | ".join(map(str, sizes)) + " |\n|---" * 1 + "|---" * len(sizes) + "|")
    for arm, c in curves.items():
        print(f"| {arm} ms | " + " | ".join(f"{c[n]:.1f}" for n in sizes) + " |")
    print("| amx / vnni | " + " | ".join(f"{curves['amx'][n] / curves['vnni'][n]:.3f}" for n in sizes) + " |")
    if args.json:
        Path(args.json).write_text(json.dumps({"model": args.model, "reps": args.reps, "ms": curves,
                                               "identical": True}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
