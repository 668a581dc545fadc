"""exact vs q8 on the default model, in ONE interleaved run: the pass curve (1..16 rows, decoding rows of separate
slots after a 64-token context, as a batch of requests), the one-row pass against the weights' streaming time at the
measured read bandwidth, and greedy tokens/s over the shipped prompts for target-only and the default draft, both
modes alternating prompt by prompt (and each speculative output checked token for token against target-only in
its own mode).

    python benchmarks/numerics.py [--reps 7] [--max-new-tokens 64] [--json out.json]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import torch

from specdec import SpecDecoder, models
from specdec.prompts import load_prompts

SIZES = (1, 2, 3, 4, 6, 8, 12, 16)


def read_bandwidth_gbs(mb: int = 256, reps: int = 10) -> float:
    """Best of `reps` sums over an mb-sized fp32 tensor (the threads torch uses)."""
    x = torch.ones(mb * (1 << 20) // 4)
    best = float("inf")
    for _ in range(reps):
        t = time.perf_counter()
        x.sum()
        best = min(best, time.perf_counter() - t)
    return mb * (1 << 20) / best / 1e9


@torch.inference_mode()
def pass_curves(model, reps: int) -> dict:
    slots = [model.acquire_slot() for _ in range(max(SIZES))]
    for s in slots:
        model.forward(list(range(1, 65)), [s] * 64, list(range(64)), [])
    times = {(m, n): [] for m in ("exact", "q8") for n in SIZES}
    for _ in range(reps + 1):  # round 0 warms up
        for n in SIZES:
            for mode in ("exact", "q8"):
                model.set_numerics(mode)
                t = time.perf_counter()
                model.forward([1] * n, slots[:n], [64] * n)
                times[(mode, n)].append((time.perf_counter() - t) * 1e3)
    for s in slots:
        model.release_slot(s)
    return {m: {n: round(statistics.median(times[(m, n)][1:]), 3) for n in SIZES} for m in ("exact", "q8")}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    path = models.resolve("default")
    model, tok = models.load("default")  # one set of weights: one mode switch serves every configuration
    sd = {d: SpecDecoder.from_models(model, tok, draft=d, tau=3) for d in ("none", "datastore+ngram")}
    curves = pass_curves(model, args.reps)
    gbs = read_bandwidth_gbs()
    stream_ms = os.path.getsize(path) / gbs / 1e6
    tokens = {(m, d): 0 for m in ("exact", "q8") for d in sd}
    seconds = dict.fromkeys(tokens, 0.0)
    identical = dict.fromkeys(tokens, True)
    for p in load_prompts(None):
        for mode in ("exact", "q8"):
            model.set_numerics(mode)
            base = None
            for d, dec in sd.items():
                t = time.perf_counter()
                out = dec.generate(p["prompt"], max_new_tokens=args.max_new_tokens, chat=p["chat"])
                seconds[(mode, d)] += time.perf_counter() - t
                tokens[(mode, d)] += len(out.token_ids)
                base = out.token_ids if d == "none" else base
                identical[(mode, d)] &= out.token_ids == base
    speed = {f"{m} {d}": round(tokens[(m, d)] / seconds[(m, d)], 2) for m, d in tokens}
    report = {"pass_ms": curves, "read_gbs": round(gbs, 1), "weights_stream_ms": round(stream_ms, 2),
              "bandwidth_fraction_at_one_row": {m: round(stream_ms / curves[m][1], 3) for m in curves},
              "ms_per_added_row_1_to_16": {m: round((curves[m][16] - curves[m][1]) / 15, 3) for m in curves},
              "tokens_per_s": speed, "identical_to_target_only": {f"{m} {d}": v for (m, d), v in identical.items()},
              "q8_over_exact": {d: round(speed[f"q8 {d}"] / speed[f"exact {d}"], 3) for d in sd}}
    print(json.dumps(report, indent=2))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2)


if __name__ == "__main__":
    main()
