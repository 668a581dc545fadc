"""Two checkouts' pass curves on one model, pass by pass: each runs in its own worker process with the model
loaded, and the driver alternates them one verify pass at a time (A, B, B, A, ...), so that the memory bandwidth
this shared machine swings by 30-50% within minutes hits both alike. Reports per size the median ms of each and the
median of the paired ratios B/A. For kernel changes that alter the layout or the bits (same_kernels.py compares a
build that must not). Its two processes are not placed alike: one-row passes whose code did not differ came out at
0.85-0.93 on the 2-core EPYC, so read a size against that control; settings the library takes at run time
(prefetch distances) compare without that bias in one process with prefetch_ab.py.

    python benchmarks/runtime.py ab-curve --against REV [--model FILE.gguf] [--rows 1,2,4,8,16] [--pairs 40] [--json out.json]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
WORKER = r"""
import os, sys, time
os.environ["HF_HUB_OFFLINE"] = "1"
from specdec import models
from specdec.kv import cached_model
model = models.load(sys.argv[1], numerics=sys.argv[2])[0]
lm = cached_model(model, model.config.vocab_size)
prompt = list(range(1, 65))
lm.forward(prompt)
print("ready", flush=True)
for line in sys.stdin:
    n = int(line)
    t = time.perf_counter()
    lm.forward(prompt + [7] * n, n)
    ms = (time.perf_counter() - t) * 1e3
    lm.rollback(len(prompt))
    print(f"{ms:.4f}", flush=True)
"""


class Worker:
    def __init__(self, checkout: Path, model: str, numerics: str):
        env = {**os.environ, "PYTHONPATH": str(checkout)}
        self.p = subprocess.Popen([sys.executable, "-c", WORKER, model, numerics], cwd=checkout, env=env,
                                  stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
        if self.p.stdout.readline().strip() != "ready":
            raise SystemExit(f"ab_curve: the worker in {checkout} did not load {model}")

    def run(self, n: int) -> float:
        self.p.stdin.write(f"{n}\n")
        self.p.stdin.flush()
        return float(self.p.stdout.readline())

    def close(self) -> None:
        self.p.stdin.close()
        self.p.wait(timeout=60)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--against", required=True, help="the git revision A (B is the working tree)")
    ap.add_argument("--model", default=str(Path("~/.cache/specdec/pair/coder15.gguf").expanduser()))
    ap.add_argument("--numerics", default="q8", choices=("q8", "exact"))
    ap.add_argument("--rows", default="1,2,4,8,16")
    ap.add_argument("--pairs", type=int, default=40, help="A/B pairs per size")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    sizes = [int(r) for r in args.rows.split(",")]
    with tempfile.TemporaryDirectory() as tmp:
        a_dir = Path(tmp) / "a"
        if subprocess.run(["git", "worktree", "add", "--detach", "-q", str(a_dir), args.against], cwd=ROOT).returncode:
            print(f"ab_curve: {args.against} is not a revision of this repository", file=sys.stderr)
            return 2
        try:
            a, b = Worker(a_dir, args.model, args.numerics), Worker(ROOT, args.model, args.numerics)
            for w in (a, b):  # warm-up
                for n in sizes:
                    w.run(n)
            times = {n: ([], []) for n in sizes}
            for i in range(args.pairs):
                for n in sizes:
                    first, second = (a, b) if i % 2 == 0 else (b, a)
                    t1, t2 = first.run(n), second.run(n)
                    ta, tb = (t1, t2) if first is a else (t2, t1)
                    times[n][0].append(ta)
                    times[n][1].append(tb)
            a.close(), b.close()
        finally:
            subprocess.run(["git", "worktree", "remove", "--force", str(a_dir)], cwd=ROOT)
    report = {"against": args.against, "model": os.path.basename(args.model), "numerics": args.numerics,
              "pairs": args.pairs, "sizes": {}}
    print(f"| rows | A ms ({args.against}) | B ms (tree) | B/A (median of pairs) |\n|---|---|---|---|")
    for n, (ta, tb) in times.items():
        row = {"a_ms": round(statistics.median(ta), 2), "b_ms": round(statistics.median(tb), 2),
               "ratio": round(statistics.median(y / x for x, y in zip(ta, tb)), 3),
               "a_all": [round(x, 3) for x in ta], "b_all": [round(y, 3) for y in tb]}
        report["sizes"][n] = row
        print(f"| {n} | {row['a_ms']} | {row['b_ms']} | {row['ratio']} |")
    a1, b1 = report["sizes"].get(1), report["sizes"].get(8)
    if a1 and b1:
        report["eight_over_one"] = {"a": round(b1["a_ms"] / a1["a_ms"], 3), "b": round(b1["b_ms"] / a1["b_ms"], 3)}
        print(f"8-row pass / 1-row pass: A {report['eight_over_one']['a']}, B {report['eight_over_one']['b']}")
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
