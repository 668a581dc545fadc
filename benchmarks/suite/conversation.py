"""Conversations about code on the real pair (benchmarks/pair.py's files and servers): each turn sends the whole
conversation so far (a module quoted in the first message, every answer, a new question), as chat clients do, one
request at a time, streamed, greedy, the servers taking turns. Each server keeps its own conversation (its own
answers), and finishes its idle-time work after each answer before the next server's request (pair.settle: a user
reading the answer gives it that time). What it shows: what a draft model costs when every request repeats a long
prefix that the target's prefix cache already holds (`ours-0.5b-uncached`: the draft's own caches off,
SPECDEC_DRAFT_PREFIX_CACHE=0).

    python benchmarks/pair.py conversation --out docs/conversation_pair.json
    python benchmarks/pair.py conversation --systems ours-none,ours-0.5b --turns 3 --max-tokens 64
"""
from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

from pair import Server, cache, fetch_model, log, request, settle, systems

HERE = Path(__file__).parent
MODULES = ["specdec/drafters/ngram.py", "specdec/runtime/prefix_cache.py"]  # the code the conversations are about
QUESTIONS = ["Explain what this module does, briefly.", "Which function is the most complex? Explain it step by step.",
             "Suggest one improvement and show the changed code.", "Write a short unit test for it.",
             "Summarise our conversation in three bullet points."]
DEFAULT_SYSTEMS = "llama,llama-md,ours-none,ours-0.5b,ours-0.5b-uncached"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--systems", default=DEFAULT_SYSTEMS)
    ap.add_argument("--turns", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    target, draft = fetch_model("coder15"), fetch_model("coder05")
    table = systems(target, draft, args.threads)
    names = args.systems.split(",")
    logs = cache() / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    servers, results = {}, {n: [] for n in names}
    try:
        for name in names:  # one at a time: a start-up competes with whatever runs beside it
            servers[name] = Server(name, table[name], logs)
            log(f"{name} ready in {servers[name].ready_s:.1f} s")
            request(servers[name], {"workload": "chat", "prompt": "Hi"}, 4)  # warm-up
        for c, module in enumerate(MODULES):
            code = (HERE.parent / module).read_text()
            history = {n: [] for n in names}
            for t in range(args.turns):
                question = QUESTIONS[t % len(QUESTIONS)]
                content = f"```python\n{code}```\n\n{question}" if t == 0 else question
                order = names[(c + t) % len(names):] + names[:(c + t) % len(names)]
                for name in order:
                    history[name].append({"role": "user", "content": content})
                    r = request(servers[name], {"workload": "chat", "messages": history[name]}, args.max_tokens)
                    history[name].append({"role": "assistant", "content": r["text"]})
                    results[name].append({"conversation": c, "turn": t, **r})
                    settle(servers[name])  # its idle-time work, before the next server's request
                log(f"conversation {c + 1}, turn {t + 1} done")
    finally:
        for s in servers.values():
            s.stop()
    report = summarize(names, results)
    print_table(report)
    if args.out:
        Path(args.out).write_text(json.dumps({**report, "config": {"turns": args.turns, "max_tokens": args.max_tokens,
                                                                   "commands": {n: table[n] for n in names}},
                                              "results": results}, indent=1) + "\n")
    return 0


def summarize(names, results) -> dict:
    """Per system: decode and end-to-end tokens/s over all turns, the first turn apart from the later ones, median
    time to first token, identity with `ours-none` (specdec) or `llama` (llama-server), turn by turn."""
    rows = {}
    for n in names:
        ref = "llama" if n.startswith("llama") else "ours-none"
        same = [r["text"] == q["text"] for r, q in zip(results[n], results.get(ref, []))]
        row = {"identical": f"{sum(same)}/{len(same)}" if ref in results else None}
        for part, rs in (("first turns", [r for r in results[n] if r["turn"] == 0]),
                         ("later turns", [r for r in results[n] if r["turn"] > 0]), ("all", results[n])):
            decode = [r for r in rs if r["decode_tps"]]
            row[part] = {"decode_tps": round(sum(r["tokens"] - 1 for r in decode) /
                                             sum((r["tokens"] - 1) / r["decode_tps"] for r in decode), 2),
                         "e2e_tps": round(sum(r["tokens"] for r in rs) / sum(r["tokens"] / r["e2e_tps"] for r in rs), 2),
                         "ttft_s": round(statistics.median(r["ttft_s"] for r in rs), 3)}
        rows[n] = row
    return {"systems": rows}


def print_table(report) -> None:
    print("| system | first turns: decode, e2e tok/s, TTFT s | later turns | all | = target-only |")
    print("|---|---|---|---|---|")
    for n, r in report["systems"].items():
        cells = [f"{r[p]['decode_tps']}, {r[p]['e2e_tps']}, {r[p]['ttft_s']}" for p in ("first turns", "later turns",
                                                                                        "all")]
        print(f"| {n} | " + " | ".join(cells) + f" | {r['identical']} |")


if __name__ == "__main__":
    raise SystemExit(main())
