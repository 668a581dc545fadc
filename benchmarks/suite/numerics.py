"""exact vs q8 on the default model, in ONE interleaved run: the verify curve (a pass over 1..16 new tokens of one
sequence after a cached prompt, logits for every row), with llama.cpp's (llama-cpp-python, `--llamacpp`) beside them;
the one-row pass against the weights' streaming time at the measured read bandwidth; and greedy tokens/s over the
shipped prompts for target-only and the default draft, both modes alternating prompt by prompt (each speculative
output checked token for token against target-only in its own mode). Each round measures every system's whole curve
in turn (a system's passes back to back, as decoding runs them, after one untimed pass), rounds alternate systems,
medians over rounds.

    python benchmarks/runtime.py numerics [--reps 7] [--max-new-tokens 64] [--llamacpp] [--json out.json]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import numpy as np
import torch

from specdec import SpecDecoder, llamacpp, models
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
def pass_curves(model, prompt: list[int], reps: int, llm=None) -> dict:
    extra = torch.randint(0, 49152, (max(SIZES),), generator=torch.Generator().manual_seed(0)).tolist()
    cache = model.new_cache()
    cache.forward(prompt)

    def specdec_pass(mode):
        def run(n):
            cache.rollback(len(prompt))
            return cache.forward(prompt + extra[:n], n)
        return mode, run

    def llama_pass(n):
        llm.n_tokens = len(prompt)  # llama-cpp-python drops the KV cache past n_tokens before evaluating
        llm.eval(extra[:n])
        return np.array(llm.scores[len(prompt): len(prompt) + n])

    systems = [specdec_pass("exact"), specdec_pass("q8")] + ([("llama.cpp", llama_pass)] if llm else [])
    if llm:
        llm.reset()
        llm.eval(prompt)
    times = {name: {n: [] for n in SIZES} for name, _ in systems}
    for r in range(reps + 1):  # round 0 warms up
        for name, run in systems:
            if name != "llama.cpp":
                model.set_numerics(name)
            run(1)  # untimed: the system's weights back in cache after the others ran
            for n in SIZES:
                t = time.perf_counter()
                run(n)
                times[name][n].append((time.perf_counter() - t) * 1e3)
    cache.close()
    return {name: {n: round(statistics.median(v[1:]), 3) for n, v in t.items()} for name, t in times.items()}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--llamacpp", action="store_true", help="llama.cpp's curve too (needs llama-cpp-python)")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    path = models.resolve("default")
    model, tok = models.load("default")  # one set of weights: one mode switch serves every configuration
    sd = {d: SpecDecoder.from_models(model, tok, draft=d, tau=3) for d in ("none", "datastore+ngram")}
    first = load_prompts(None)[0]["prompt"]
    prompt = tok.apply_chat_template([{"role": "user", "content": first}], tokenize=True, add_generation_prompt=True)
    curves = pass_curves(model, prompt, args.reps, llamacpp.load(path, logits_all=True) if args.llamacpp else None)
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
