"""Decode speed at long contexts, K/V stored as fp16 (the q8 mode's default) against fp32, and the peak resident
memory of each. Each (context, storage) runs in a process of its own (so its peak is its own), alternating storage
run by run: prefill `context` positions of real text in chunks, then time `--steps` one-token greedy steps.

    python benchmarks/serve.py long-context [--contexts 4096 8192] [--steps 64] [--rounds 2] [--json out.json]
"""
from __future__ import annotations

import argparse
import json
import resource
import statistics
import subprocess
import sys
import time


def one(context: int, storage: str, steps: int) -> dict:
    import torch

    from specdec import models
    from specdec.prompts import HERE, load_prompts
    model, tok = models.load("default", backend="runtime", numerics="q8")
    model.set_kv_dtype(torch.float32 if storage == "fp32" else torch.float16)
    text = "\n\n".join(p["prompt"] for p in load_prompts(HERE / "grounded.jsonl") + load_prompts())
    ids = tok(text, add_special_tokens=False).input_ids
    ids = (ids * (context // len(ids) + 1))[:context]
    cache = model.new_cache()
    with torch.inference_mode():
        for end in range(512, context + 512, 512):
            cache.forward(ids[:min(end, context)], 1)
        token = int(cache.forward(ids, 1)[-1].argmax())
        times = []
        for _ in range(steps):
            t = time.perf_counter()
            ids.append(token)
            token = int(cache.forward(ids, 1)[-1].argmax())
            times.append(time.perf_counter() - t)
    return {"context": context, "storage": storage, "tokens_per_s": round(1 / statistics.median(times), 1),
            "kv_mb": round(model.kv_bytes() / 2**20, 1),
            "peak_rss_mb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--contexts", type=int, nargs="+", default=[4096, 8192])
    ap.add_argument("--steps", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--json", default=None)
    ap.add_argument("--one", nargs=2, default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.one:
        print(json.dumps(one(int(args.one[0]), args.one[1], args.steps)))
        return
    runs = []
    for r in range(args.rounds):
        for context in args.contexts:
            for storage in (("fp16", "fp32") if r % 2 == 0 else ("fp32", "fp16")):
                out = subprocess.run([sys.executable, __file__, "--one", str(context), storage, "--steps",
                                      str(args.steps)], capture_output=True, text=True, check=True)
                runs.append(json.loads(out.stdout.strip().splitlines()[-1]))
                print(runs[-1], flush=True)
    table = []
    for context in args.contexts:
        for storage in ("fp16", "fp32"):
            mine = [x for x in runs if x["context"] == context and x["storage"] == storage]
            table.append({"context": context, "storage": storage,
                          "tokens_per_s": statistics.median(x["tokens_per_s"] for x in mine),
                          "kv_mb": mine[0]["kv_mb"], "peak_rss_mb": max(x["peak_rss_mb"] for x in mine)})
    for row in table:
        print(f"{row['context']:>6} {row['storage']}: {row['tokens_per_s']:7.1f} tokens/s, K/V {row['kv_mb']:7.1f} MB, "
              f"peak RSS {row['peak_rss_mb']:7.1f} MB")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"runs": runs, "table": table}, f, indent=1)


if __name__ == "__main__":
    main()
