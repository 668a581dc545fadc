"""The real target's pass curve: ms of one verify pass over n new tokens (n = 1..16) after a cached prompt, on our
runtime in q8 and exact numerics and on llama.cpp (`llama-bench -p n`: a prompt pass of n tokens), interleaved
size by size; plus the machine's read bandwidth and the fraction of it a one-row q8 pass reaches (the bytes a pass
must read over its time): against the best read of the whole run (`q8_one_row_bandwidth_fraction`, the median pass
against the best read) and pass by pass (`..._paired`: each one-row pass beside a read of the same bytes by torch,
the median of their ratios; this machine's bandwidth swings by a third within minutes).

    python benchmarks/pair.py curve --out docs/pair_curve.json
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path
from statistics import median
from time import perf_counter

import torch

sys.path.insert(0, str(Path(__file__).parent))
from pair import cpu_name, fetch_model, llama_bin  # noqa: E402

from specdec import models  # noqa: E402
from specdec.costs import measure_verify_curve  # noqa: E402
from specdec.runtime.q8cache import q8_weights  # noqa: E402


def read_bandwidth_gbs(gib: int = 1, reps: int = 7) -> float:
    """The best of `reps` sums over `gib` GiB of fp32 (every core, as the kernels run): read bytes per second."""
    x = torch.ones(gib * 2**28, dtype=torch.float32)
    x.sum()
    best = float("inf")
    for _ in range(reps):
        t = perf_counter()
        x.sum()
        best = min(best, perf_counter() - t)
    return gib * 2**30 / best / 1e9


def paired_fraction(model, pass_bytes: int, pairs: int = 40) -> dict:
    """One-row q8 passes, each right after torch reads as many bytes as the pass must (every core): the median of
    (read time / pass time), and the medians of each."""
    from specdec.kv import cached_model
    lm = cached_model(model, model.config.vocab_size)
    prompt = list(range(1, 65))
    lm.forward(prompt)
    x = torch.ones(pass_bytes // 4, dtype=torch.float32)
    x.sum()
    reads, passes = [], []
    for i in range(pairs):
        t = perf_counter()
        x.sum()
        reads.append(perf_counter() - t)
        t = perf_counter()
        lm.forward(prompt + [7 + i], 1)
        passes.append(perf_counter() - t)
        lm.rollback(len(prompt))
    return {"fraction": round(median(r / p for r, p in zip(reads, passes)), 3),
            "read_gbs": round(pass_bytes / median(reads) / 1e9, 1), "one_row_ms": round(1e3 * median(passes), 2)}


def llama_pass_ms(target: Path, sizes: list[int], threads: int, reps: int) -> dict[int, float]:
    """llama-bench's prompt pass of n tokens (pp n, no generation), as ms per pass."""
    out = subprocess.run([str(llama_bin("llama-bench")), "-m", str(target), "-t", str(threads), "-n", "0",
                          "-p", ",".join(map(str, sizes)), "-r", str(reps), "-o", "json"],
                         check=True, capture_output=True, text=True).stdout
    return {r["n_prompt"]: 1e3 * r["n_prompt"] / r["avg_ts"] for r in json.loads(out)}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--max-rows", type=int, default=16)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--rounds", type=int, default=2, help="alternations of the three systems")
    ap.add_argument("--systems", default="q8,exact,llama.cpp", help="comma-separated: q8 first (pair.py takes q8)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    target = fetch_model("coder15")
    sizes = list(range(1, args.max_rows + 1))
    threads = torch.get_num_threads()
    runs = {name: [] for name in args.systems.split(",")}
    if "q8" not in runs or any(n not in ("q8", "exact", "llama.cpp") for n in runs):
        raise SystemExit("pair_curve: --systems are q8 (always), exact and llama.cpp")
    bandwidth = []
    loaded = {}
    for _ in range(args.rounds):  # the systems alternate, so drift hits each alike
        for name in runs:
            if name == "llama.cpp":
                runs[name].append(llama_pass_ms(target, sizes, threads, args.reps))
                continue
            if name not in loaded:
                loaded[name] = models.load(str(target), numerics=name)[0]
            model = loaded[name]
            runs[name].append(measure_verify_curve(model, model.config.vocab_size, list(range(1, 65)),
                                                   args.max_rows, reps=args.reps))
        bandwidth.append(read_bandwidth_gbs())
    curves = {name: {n: round(median(r[n] for r in rs), 2) for n in sizes} for name, rs in runs.items()}
    q8 = loaded["q8"]
    pass_bytes = sum(w.packed().numel() if w.packed() is not None else w.data.numel() for w in q8_weights(q8))
    gbs = max(bandwidth)
    report = {"cpu": cpu_name(), "threads": threads, "curves_ms": curves,
              "ratio_to_one_row": {k: {n: round(c[n] / c[1], 3) for n in sizes} for k, c in curves.items()},
              "read_bandwidth_gbs": round(gbs, 1), "q8_bytes_per_pass": pass_bytes,
              "q8_one_row_bandwidth_fraction": round(pass_bytes / gbs / 1e6 / curves["q8"][1], 3),
              "q8_one_row_bandwidth_fraction_paired": paired_fraction(q8, pass_bytes),
              "file_bytes": os.path.getsize(target)}
    print("| rows | " + " | ".join(str(n) for n in sizes) + " |")
    print("|---" * (len(sizes) + 1) + "|")
    for name, c in curves.items():
        print(f"| {name} ms | " + " | ".join(f"{c[n]:.1f}" for n in sizes) + " |")
    print(f"read bandwidth {gbs:.1f} GB/s; a q8 pass reads {pass_bytes / 1e9:.3f} GB: one row at "
          f"{report['q8_one_row_bandwidth_fraction']:.0%} of the limit; pass by pass beside a read of its bytes: "
          f"{report['q8_one_row_bandwidth_fraction_paired']}")
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
