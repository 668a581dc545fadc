"""Start-up on the real target, alternating the systems round by round: time until `specdec serve` and llama-server
answer /health, and a cold `specdec generate` (a new process, 32 tokens): wall time and peak RSS. With --previous, an
earlier release's checkout is measured beside this one. Each specdec system gets its own cache directory, filled
by one untimed warm-up (the q8 layout, measured pass costs, the tokenizer): two releases sharing one would delete
each other's q8 layouts (a build removes the same file's layouts from other kernel builds), so every timed start
would repack.

    python benchmarks/pair.py startup --rounds 3 --previous /tmp/prev --out docs/startup.json
"""
from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from statistics import median

sys.path.insert(0, str(Path(__file__).parent))
from pair import Server, fetch_model, llama_bin  # noqa: E402

PROMPT = "Write a Python function that reverses a string."


def specdec_cmd(previous: str | None) -> list[str]:
    if previous is None:
        return [str(Path(sys.executable).with_name("specdec"))]
    return [sys.executable, "-c", f"import sys; sys.path.insert(0, {previous!r}); from specdec.cli import main; "
            "sys.exit(main())"]


def peak_rss_mb(cmd: list[str], target: Path) -> float:
    """Peak RSS of one cold `generate` process (GNU time's %M)."""
    out = subprocess.run(["/usr/bin/time", "-f", "%M", *cmd, "generate", PROMPT, "--target", str(target),
                          "--max-new-tokens", "32"], check=True, capture_output=True, text=True).stderr
    return int(out.strip().splitlines()[-1]) / 1024


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--previous", default=None)
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    target = fetch_model("coder15")
    logs = Path("/tmp/specdec-startup-logs")
    logs.mkdir(exist_ok=True)
    caches = Path(tempfile.mkdtemp(prefix="specdec-startup-"))
    systems = {"ours": specdec_cmd(None), **({"prev": specdec_cmd(args.previous)} if args.previous else {})}
    systems = {name: ["env", f"SPECDEC_CACHE={caches / name}", *cmd] for name, cmd in systems.items()}
    serve = {name: [*cmd, "serve", "--target", str(target), "--host", "127.0.0.1", "--port", "PORT"]
             for name, cmd in systems.items()}
    serve["llama-server"] = [str(llama_bin()), "-m", str(target), "-c", "4096", "-np", "1", "--host", "127.0.0.1",
                             "--port", "PORT"]
    ready, gen = {n: [] for n in serve}, {n: [] for n in systems}
    for name, cmd in systems.items():  # warm-up, untimed: each system's cache built once
        Server(name, serve[name], logs).stop()
        peak_rss_mb(cmd, target)
    for r in range(args.rounds):
        for name, cmd in serve.items():  # one server at a time, nothing else running
            s = Server(name, cmd, logs)
            ready[name].append(s.ready_s)
            s.stop()
        for name, cmd in systems.items():
            wall = time.monotonic()
            rss = peak_rss_mb(cmd, target)
            gen[name].append((time.monotonic() - wall, rss))
        print(f"round {r + 1}: " + ", ".join(f"{n} ready {v[-1]:.2f} s" for n, v in ready.items()) + "; " +
              ", ".join(f"{n} generate {v[-1][0]:.2f} s {v[-1][1]:.0f} MB" for n, v in gen.items()), flush=True)
    report = {"file_mb": round(target.stat().st_size / 2**20),
              "ready_s": {n: {"median": round(median(v), 2), "all": [round(x, 2) for x in v]} for n, v in ready.items()},
              "generate": {n: {"wall_s_median": round(median(w for w, _ in v), 2),
                               "peak_rss_mb_median": round(median(m for _, m in v)),
                               "all": [[round(w, 2), round(m)] for w, m in v]} for n, v in gen.items()}}
    shutil.rmtree(caches, ignore_errors=True)
    print(json.dumps(report, indent=1))
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
