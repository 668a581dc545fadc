"""Free drafts and token trees on the runtime: every draft against target-only, per workload, in ONE interleaved
run (prompt by prompt, every configuration in turn, so machine drift hits all alike).

    python benchmarks/draft.py trees [--max-new-tokens 64] [--out docs/trees.json]

Workloads: chat and code completion (the shipped chat/code sets and prompts/more.jsonl), input-grounded
(prompts/grounded.jsonl: edit, reformat, quote or answer from a given text), and seeded sampling at T=0.7 and 1.0
on the chat set. The recycle table starts empty and is first warmed on 16 prompts of prompts/distill.jsonl (other
traffic, never the benchmark's prompts); it keeps learning during the run, as a server's does. Each row: tokens/s,
target passes per token, nodes verified per pass, accepted drafts per pass, draft ms per cycle, speedup over
target-only, and whether every output equals target-only's (greedy: token ids; sampled: the same seed's tokens).
"""
from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path
from time import perf_counter

from specdec import SpecDecoder
from specdec.prompts import HERE, load_prompts

# shipped: the feature draft (EAGLE-2 trees when greedy, chains with q when sampling)
DRAFTS = ["recycle", "ngram", "datastore", "shipped", "datastore+ngram", "datastore+ngram+recycle",
          "datastore+ngram+shipped"]


def workloads() -> dict[str, tuple[list[dict], list[dict]]]:
    chat = load_prompts(HERE / "chat.jsonl")
    code = load_prompts(HERE / "code.jsonl") + load_prompts(HERE / "more.jsonl")
    greedy = {}
    return {
        "chat+code": (chat + code, [greedy]),
        "grounded": (load_prompts(HERE / "grounded.jsonl"), [greedy]),
        "sampled": (chat, [{"temperature": 0.7}, {"temperature": 1.0}]),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--tau", type=int, default=3)
    ap.add_argument("--drafts", default=",".join(DRAFTS))
    ap.add_argument("--warm", type=int, default=16, help="distill prompts that warm the recycle table")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    table = Path(tempfile.mkdtemp()) / "recycle.safetensors"
    base = SpecDecoder(draft="none")
    model, tok = base.model, base.tokenizer
    warm = SpecDecoder.from_models(model, tok, f"recycle:{table}", tau=args.tau)
    for p in load_prompts(HERE / "distill.jsonl")[: args.warm]:
        warm.generate(p["prompt"], max_new_tokens=args.max_new_tokens, chat=p["chat"])
    warm.engine.drafter.persist()
    drafts = [d.replace("recycle", f"recycle:{table}") for d in args.drafts.split(",")]
    decoders = {"none": base} | {d: SpecDecoder.from_models(model, tok, d, tau=args.tau) for d in drafts}
    results = {}
    for name, (prompts, settings) in workloads().items():
        rows = {d: dict(tokens=0, seconds=0.0, passes=0, nodes=0, accepted=0, draft_ms=0.0, identical=True)
                for d in decoders}
        for i, p in enumerate(prompts):
            for kw in settings:
                kw = dict(kw, seed=1000 + i) if kw else kw
                ref = None
                for d, sd in decoders.items():
                    t = perf_counter()
                    out = sd.generate(p["prompt"], max_new_tokens=args.max_new_tokens, chat=p["chat"], **kw)
                    dt = perf_counter() - t
                    r = rows[d]
                    r["tokens"] += len(out.token_ids)
                    r["seconds"] += dt
                    r["passes"] += len(out.records)
                    r["nodes"] += sum(len(c.proposed) for c in out.records)
                    r["accepted"] += sum(c.accepted for c in out.records)
                    r["draft_ms"] += sum(c.draft_ms for c in out.records)
                    ref = out.token_ids if d == "none" else ref
                    r["identical"] &= out.token_ids == ref
            print(f"{name}: prompt {i + 1}/{len(prompts)}", file=sys.stderr)
        t0 = rows["none"]["tokens"] / rows["none"]["seconds"]
        results[name] = {d.replace(f"recycle:{table}", "recycle"): {
            "tokens_per_s": round(r["tokens"] / r["seconds"], 1),
            "speedup": round(r["tokens"] / r["seconds"] / t0, 3),
            "tokens_per_pass": round(r["tokens"] / r["passes"], 3),
            "nodes_per_pass": round(r["nodes"] / r["passes"], 2),
            "accepted_per_pass": round(r["accepted"] / r["passes"], 3),
            "draft_ms_per_cycle": round(r["draft_ms"] / r["passes"], 3),
            "identical": r["identical"]} for d, r in rows.items()}
    print("| workload | draft | tokens/s | speedup | tokens/pass | nodes/pass | accepted/pass | draft ms/cycle | "
          "identical |\n|---|---|---|---|---|---|---|---|---|")
    for name, rows in results.items():
        for d, r in rows.items():
            print(f"| {name} | {d} | {r['tokens_per_s']} | {r['speedup']}x | {r['tokens_per_pass']} | "
                  f"{r['nodes_per_pass']} | {r['accepted_per_pass']} | {r['draft_ms_per_cycle']} | "
                  f"{'yes' if r['identical'] else 'NO'} |")
    if args.out:
        Path(args.out).write_text(json.dumps({"max_new_tokens": args.max_new_tokens, "tau": args.tau,
                                              "results": results}, indent=1) + "\n")


if __name__ == "__main__":
    main()
