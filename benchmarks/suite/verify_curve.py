"""The target's verify curve T(n), one pass over n new tokens after a cached prompt, on specdec's runtime and on
llama.cpp (llama-cpp-python, logits for every row as verification needs), sizes and systems interleaved so machine
drift hits all alike. Also: does each system give a row of a multi-token pass the same argmax as a one-token pass?

    python benchmarks/runtime.py verify-curve --max-n 8 --reps 15 [--json curve.json]
"""
from __future__ import annotations

import argparse
import json
import statistics
import time

import numpy as np
import torch

from specdec import llamacpp, models
from specdec.costs import expected_tokens
from specdec.prompts import load_prompts


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--max-n", type=int, default=8)
    ap.add_argument("--reps", type=int, default=15)
    ap.add_argument("--alpha", type=float, default=0.6, help="acceptance per position for the illustration")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()

    path = models.resolve("default")
    rt, tok = models.load("default", backend="runtime")
    llm = llamacpp.load(path, logits_all=True)
    prompt = tok.apply_chat_template([{"role": "user", "content": load_prompts(None)[0]["prompt"]}],
                                     tokenize=True, add_generation_prompt=True)
    extra = torch.randint(0, 49152, (args.max_n,), generator=torch.Generator().manual_seed(0)).tolist()
    cache = rt.new_cache()
    cache.forward(prompt)
    llm.reset()
    llm.eval(prompt)

    def run_runtime(n):
        cache.rollback(len(prompt))
        return cache.forward(prompt + extra[:n], n)

    def run_llamacpp(n):
        llm.n_tokens = len(prompt)  # llama-cpp-python drops the KV cache past n_tokens before evaluating
        llm.eval(extra[:n])
        return np.array(llm.scores[len(prompt): len(prompt) + n])

    times = {s: {n: [] for n in range(1, args.max_n + 1)} for s in ("runtime", "llama.cpp")}
    for n in (1, args.max_n):  # warm-up
        run_runtime(n), run_llamacpp(n)
    for _ in range(args.reps):
        for n in range(1, args.max_n + 1):
            for system, fn in (("runtime", run_runtime), ("llama.cpp", run_llamacpp)):
                t0 = time.perf_counter()
                fn(n)
                times[system][n].append((time.perf_counter() - t0) * 1e3)
    curve = {s: {n: round(statistics.median(v), 2) for n, v in t.items()} for s, t in times.items()}

    # row-invariance: the argmax of each row of an n-row pass vs one-token passes over the same tokens
    seq = extra[: args.max_n]
    one_rt = torch.cat([run_one(cache, prompt, seq, i) for i in range(len(seq))])
    full_rt = run_runtime(len(seq))
    one_ll = np.stack([one_llama(llm, prompt, seq, i) for i in range(len(seq))])
    full_ll = run_llamacpp(len(seq))
    report = {
        "verify_ms": curve,
        "relative_to_one_token": {s: {n: round(c[n] / c[1], 3) for n in c} for s, c in curve.items()},
        "bitwise_row_invariant": {"runtime": bool(torch.equal(one_rt, full_rt)),
                                  "llama.cpp": bool(np.array_equal(one_ll, full_ll))},
        "argmax_agrees": {"runtime": int((one_rt.argmax(-1) == full_rt.argmax(-1)).sum()),
                          "llama.cpp": int((one_ll.argmax(-1) == full_ll.argmax(-1)).sum()), "of": len(seq)},
        "illustration": {s: {f"tau={n - 1}": round(expected_tokens([args.alpha] * (n - 1), n - 1) * c[1] / c[n], 3)
                             for n in c if n > 1} for s, c in curve.items()},
        "illustration_note": f"speedup over one-token decoding with a free draft of acceptance {args.alpha}/position",
    }
    print(json.dumps(report, indent=1))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)


def run_one(cache, prompt, seq, i):
    cache.rollback(len(prompt) + i)
    return cache.forward(prompt + seq[: i + 1], 1)


def one_llama(llm, prompt, seq, i):
    llm.n_tokens = len(prompt)
    for t in seq[: i + 1]:  # one token per pass all the way
        llm.eval([t])
    return np.array(llm.scores[len(prompt) + i])


if __name__ == "__main__":
    main()
