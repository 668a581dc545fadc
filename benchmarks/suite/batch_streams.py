"""N streams through the server's batch engine in one process, the drafts interleaved round by round: what a draft
costs or saves at a load, without HTTP and with far less noise than servers taking turns, and where the time goes.

    python benchmarks/serve.py batch-streams [--target coder15.gguf] [--drafts none,distilled,coder05.gguf]
        [--streams 8] [--rounds 3] [--workloads completion,chat,edits] [--out FILE]

Each round runs every draft (the order reversed on odd rounds) on the same requests: `streams` at a time, 4 per
stream, 128 tokens, greedy, the pair's prompts (benchmarks/suite/pair_prompts.jsonl) with their quoted-block
predictions as the server makes them. Per draft: tokens/s over all rounds, passes, rows a pass, draft rows, the
ms a step spends outside the target pass (drafting and bookkeeping), and each pass size's median ms. Every answer
must equal the first draft's (list `none` first: target-only).

A draft named `D@uncorrected` runs D with the split's hindsight measured but never read (batch/hindsight.py): the
same run then says what the correction is worth. Each draft's report holds the accepted share of its draft rows and
hindsight's accepted / expected by load.
"""
from __future__ import annotations

import argparse
import collections
import json
import os
import statistics
from pathlib import Path
from time import perf_counter

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from specdec.api import SpecDecoder  # noqa: E402
from specdec.batch import Sequence  # noqa: E402
from specdec.batch.hindsight import LEVELS, Hindsight  # noqa: E402
from specdec.server.app import batch_engine  # noqa: E402

PROMPTS = Path(__file__).with_name("pair_prompts.jsonl")
PER_STREAM, MAX_TOKENS = 4, 128


class Uncorrected(Hindsight):
    """Measures what the split's rows were expected to add and what was accepted, but never corrects the split."""

    def ratio(self, decoding: int, valued: bool = False) -> float:
        return 1.0


def window(sd, engine, prompts: list[dict], streams: int) -> tuple[int, float, list[tuple], dict]:
    """One round: `streams` requests at a time -> (tokens, seconds, per pass (rows, draft rows, ms of the target
    pass, ms of the step, draft tokens accepted), answers by prompt index)."""
    queue = collections.deque((c + k * streams) % len(prompts) for k in range(PER_STREAM) for c in range(streams))
    running = {}

    def add():
        i = queue.popleft()
        p = prompts[i]
        req = sd.prepare(p["prompt"], max_new_tokens=MAX_TOKENS, chat=p["workload"] != "completion")
        running[i] = engine.add(Sequence(req.prompt_ids, MAX_TOKENS, req.params, prediction=req.prediction,
                                         prediction_prior=req.prediction_prior))
    for _ in range(min(streams, len(queue))):
        add()
    passes, tokens, answers, t0 = [], 0, {}, perf_counter()
    while engine.running or queue:
        t = perf_counter()
        out = engine.step()
        ms = (perf_counter() - t) * 1e3
        if engine.last:
            passes.append((engine.last["rows"], sum(engine.last["taus"]), engine.last["verify_ms"], ms,
                           sum(rec.accepted for _, rec in out if rec is not None)))
        tokens += sum(len(rec.emitted) for _, rec in out if rec is not None)
        for i, s in list(running.items()):
            if s not in engine.running:
                answers[i] = s.generated
                del running[i]
        while len(engine.running) < streams and queue:
            add()
    return tokens, perf_counter() - t0, passes, answers


def summary(runs: list[tuple]) -> dict:
    tokens, wall = sum(r[0] for r in runs), sum(r[1] for r in runs)
    passes = [p for r in runs for p in r[2]]
    by_rows = collections.defaultdict(list)
    for rows, _, verify, *_ in passes:
        by_rows[rows].append(verify)
    return {"tokens_per_s": round(tokens / wall, 1), "by_round": [round(r[0] / r[1], 1) for r in runs],
            "passes": len(passes), "rows_per_pass": round(statistics.mean(p[0] for p in passes), 2),
            "draft_rows": sum(p[1] for p in passes),
            "accepted_share": round(sum(p[4] for p in passes) / max(1, sum(p[1] for p in passes)), 3),
            "outside_pass_ms": round(statistics.mean(p[3] - p[2] for p in passes), 2),
            "pass_ms_by_rows": {n: round(statistics.median(v), 1) for n, v in sorted(by_rows.items()) if len(v) >= 5}}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--target", default=str(Path.home() / ".cache/specdec/pair/coder15.gguf"))
    ap.add_argument("--drafts", default="none,distilled")
    ap.add_argument("--streams", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--workloads", default="completion,chat,edits")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    kinds = args.workloads.split(",")
    prompts = [p for p in map(json.loads, PROMPTS.read_text().splitlines()) if p["workload"] in kinds]
    drafts = args.drafts.split(",")
    systems = {}
    for d in drafts:
        sd = SpecDecoder(target=args.target, draft=d.removesuffix("@uncorrected"))
        systems[d] = (sd, batch_engine(sd, None, 32))
        if d.endswith("@uncorrected"):
            systems[d][1].hindsight = Uncorrected()
    runs, answers = {d: [] for d in drafts}, {}
    for r in range(args.rounds):
        for d in drafts if r % 2 == 0 else drafts[::-1]:
            tokens, wall, passes, said = window(*systems[d], prompts, args.streams)
            runs[d].append((tokens, wall, passes))
            answers.setdefault(d, {}).update(said)
            print(f"round {r + 1}: {d}: {tokens / wall:.1f} tokens/s", flush=True)
    report = {d: summary(rs) for d, rs in runs.items()}
    for d, (_, engine) in systems.items():
        report[d]["hindsight"] = {name: round(engine.hindsight.measured(i), 3) for i, name in enumerate(LEVELS)}
    for d in drafts:
        report[d]["identical"] = f"{sum(answers[d][i] == answers[drafts[0]][i] for i in answers[d])}/{len(answers[d])}"
        report[d]["vs_first"] = round(report[d]["tokens_per_s"] / report[drafts[0]]["tokens_per_s"], 3)
    print("| draft | tokens/s | by round | vs first | passes | rows/pass | draft rows | accepted | hindsight 8+ "
          "| ms outside the pass | = first |")
    print("|---" * 11 + "|")
    for d, r in report.items():
        print(f"| {d} | {r['tokens_per_s']} | {r['by_round']} | {r['vs_first']} | {r['passes']} | {r['rows_per_pass']} "
              f"| {r['draft_rows']} | {r['accepted_share']} | {r['hindsight']['8+']} | {r['outside_pass_ms']} "
              f"| {r['identical']} |")
    if args.out:
        Path(args.out).write_text(json.dumps({"streams": args.streams, "rounds": args.rounds, "workloads": kinds,
                                              "target": args.target, "report": report}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
