"""When a feature draft proposes in the batch engine: before the row split (its trees sized on their own node
values, batch.EARLY_MODEL_BATCH) or after it (sized on the request's running acceptance). One process, one request
at a time, the two ways alternated prompt by prompt (the order rotating), so machine drift hits both alike.

    python benchmarks/draft.py early-trees [--target coder15.gguf] [--draft ngram+distilled] [--reps 2] [--out FILE]

Prompts: the pair's completions, chats and edits (benchmarks/suite/pair_prompts.jsonl; chats and edits through the chat
template), greedy, 128 tokens. Per workload: decode tokens/s after the first token and tokens a pass, each way, and
the ratio of the speeds. The outputs must be the same both ways (greedy: the target's tokens).
"""
from __future__ import annotations

import argparse
import json
import os
from pathlib import Path
from time import perf_counter

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from specdec.api import SpecDecoder  # noqa: E402
from specdec.batch import Sequence  # noqa: E402
from specdec.sampling import SamplingParams  # noqa: E402
from specdec.server.app import batch_engine  # noqa: E402

PROMPTS = Path(__file__).with_name("pair_prompts.jsonl")


def decode(engine, ids: list[int], max_new_tokens: int) -> tuple[list[int], float, int, int]:
    """One request alone -> (its tokens, seconds after its first token, passes and tokens after it)."""
    seq = engine.add(Sequence(list(ids), max_new_tokens, SamplingParams()))
    t0, passes = None, 0
    while engine.running:
        engine.step()
        if t0 is None and seq.generated:
            t0, first = perf_counter(), len(seq.generated)
        elif t0 is not None:
            passes += 1
    return seq.generated, perf_counter() - t0, passes, len(seq.generated) - first


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--target", default=str(Path.home() / ".cache/specdec/pair/coder15.gguf"))
    ap.add_argument("--draft", default="ngram+distilled")
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    dec = SpecDecoder(target=args.target, draft=args.draft)
    engine = batch_engine(dec, None, 32)
    if not engine.early_model:
        raise SystemExit(f"early_trees: --draft {args.draft} grows no trees: nothing to compare")
    tok = dec.tokenizer
    prompts = [p for p in map(json.loads, PROMPTS.read_text().splitlines()) if p["workload"] in
               ("completion", "chat", "edits")]
    sums = {w: {way: [0.0, 0, 0] for way in ("before", "after")} for w in ("completion", "chat", "edits")}
    same = True
    for rep in range(args.reps):
        for i, p in enumerate(prompts):
            if p["workload"] == "completion":
                ids = tok(p["prompt"]).input_ids
            else:
                ids = tok.apply_chat_template([{"role": "user", "content": p["prompt"]}], add_generation_prompt=True)
                ids = ids["input_ids"] if hasattr(ids, "keys") else ids
            outs = {}
            for way in (("before", "after") if (i + rep) % 2 == 0 else ("after", "before")):
                engine.early_model = way == "before"
                outs[way], seconds, passes, tokens = decode(engine, ids, args.max_new_tokens)
                s = sums[p["workload"]][way]
                s[0], s[1], s[2] = s[0] + seconds, s[1] + tokens, s[2] + passes
            same &= outs["before"] == outs["after"]
    report = {"target": args.target, "draft": args.draft, "reps": args.reps, "identical": same, "workloads": {}}
    for w, ways in sums.items():
        row = {way: {"decode_tps": round(t / s, 2), "tokens_per_pass": round(t / n, 3)} for way, (s, t, n) in
               ways.items()}
        row["speed_ratio"] = round(row["before"]["decode_tps"] / row["after"]["decode_tps"], 3)
        report["workloads"][w] = row
        print(f"{w:10s} before {row['before']['decode_tps']:6.1f} tok/s {row['before']['tokens_per_pass']:.2f}/pass"
              f"   after {row['after']['decode_tps']:6.1f} tok/s {row['after']['tokens_per_pass']:.2f}/pass"
              f"   {row['speed_ratio']:.3f}x")
    print("outputs identical both ways:", same)
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=1) + "\n")


if __name__ == "__main__":
    main()
