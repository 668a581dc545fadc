"""Load test for `specdec serve` on loopback: N concurrent streaming clients for a bounded time per level, then a
burst of malformed requests. Per level: requests/s, aggregate tokens/s, p50/p95 time to first token and inter-token
latency, mean rows per target pass and mean τ (from /metrics), errors by status, hung connections and the server's
RSS. Outputs served under load (greedy, and seeded sampling: each prompt has its seed) are compared with the same
requests served alone afterwards.

    python benchmarks/serve.py load --spawn --levels 1,4,16,32 --duration 60 --temperatures 0,0.7 --out docs/load.json
    python benchmarks/serve.py load --spawn --levels 1 --duration 20 --rounds 3 --baseline "--max-queue 64 --no-batch"
        # the same level against a second server (one request at a time), windows alternating between the two
    git worktree add /tmp/prev <previous release> && python benchmarks/serve.py load --spawn --levels 1,16 --rounds 2 \
        --baseline "--max-queue 64" --baseline-src /tmp/prev   # the previous release's code as the baseline
    python benchmarks/serve.py load --url http://127.0.0.1:8000 --pid SERVER_PID
    python benchmarks/serve.py load --spawn --levels 8 --duration 60 --dashboard docs/dashboard.png   # + its dashboard
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import socket
import statistics
import subprocess
import sys
import time
from collections import Counter, defaultdict

import httpx
from prometheus_client.parser import text_string_to_metric_families

PROMPTS = ["What is a linked list?", "Give me two tips for focus.", "Why do cats purr?", "Explain recursion briefly.",
           "Write a haiku about rain.", "What is the boiling point of water?",
           "Write a Python function that reverses a string.", "How do I read a file line by line in Python?",
           "What does HTTP 404 mean?", "Name three prime numbers.", "Write a SQL query counting rows in a table.",
           "Summarise what a hash map is in one sentence."]
MALFORMED = [b"{not json", b'{"messages": "x"}', b'{"messages": []}', b'{"messages": [{"role": "user"}]}',
             b'{"messages": [{"role": "user", "content": "hi"}], "max_tokens": 0}',
             b'{"messages": [{"role": "user", "content": "hi"}], "temperature": -1}',
             b'{"messages": [{"role": "user", "content": "hi"}], "top_p": 7}', b"[]", b"",
             b'{"messages": [{"role": "user", "content": "hi"}], "model": "nope"}']


def rss_mb(pid: int | None) -> float | None:
    if not pid:
        return None
    try:
        with open(f"/proc/{pid}/status") as f:
            return next(int(line.split()[1]) / 1024 for line in f if line.startswith("VmRSS"))
    except OSError:
        return None


async def one_request(hc, url, prompt, max_tokens, temperature, seed=None) -> dict:
    """One streamed chat completion -> status, text, tokens, ttft, gaps between content events, latency."""
    body = {"messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens, "temperature": temperature,
            "stream": True, "stream_options": {"include_usage": True}}
    if seed is not None:
        body["seed"] = seed
    t0 = time.monotonic()
    out = {"status": None, "text": "", "tokens": 0, "ttft": None, "gaps": []}
    async with hc.stream("POST", url + "/v1/chat/completions", json=body) as r:
        out["status"] = r.status_code
        if r.status_code != 200:
            await r.aread()
            return out
        last = None
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            data = json.loads(line[6:])
            if data.get("usage"):
                out["tokens"] = data["usage"]["completion_tokens"]
            elif data.get("choices") and data["choices"][0]["delta"].get("content"):
                now = time.monotonic()
                if out["ttft"] is None:
                    out["ttft"] = now - t0
                else:
                    out["gaps"].append(now - last)
                last = now
                out["text"] += data["choices"][0]["delta"]["content"]
    out["latency"] = time.monotonic() - t0
    return out


def seed_of(prompt: str, temperature: float) -> int | None:
    """Sampled requests carry a seed fixed by their prompt, so that each text served under load can be compared with
    the same request served alone (seeded sampling must not depend on the batch)."""
    return None if temperature == 0 else 1000 + PROMPTS.index(prompt)


async def stream_client(hc, url, stop_at, args, temperature, out, rng):
    while time.monotonic() < stop_at:
        prompt = rng.choice(PROMPTS)
        seed = seed_of(prompt, temperature)
        try:
            r = await one_request(hc, url, prompt, args.max_tokens, temperature, seed)
        except httpx.TimeoutException:
            out["hung"] += 1
            continue
        except httpx.HTTPError as e:
            out["errors"][type(e).__name__] += 1
            continue
        out["status"][r["status"]] += 1
        if r["status"] != 200:
            await asyncio.sleep(0.2)  # back off on 429
            continue
        out["latency"].append(r["latency"])
        out["ttft"].append(r["ttft"] if r["ttft"] is not None else r["latency"])
        out["gaps"].extend(r["gaps"])
        out["tokens"] += r["tokens"]
        out["done"] += 1
        out["texts"][prompt].add(r["text"])


async def malformed_burst(hc, url: str, n: int) -> Counter:
    async def one(i):
        try:
            r = await hc.post(url + "/v1/chat/completions", content=MALFORMED[i % len(MALFORMED)],
                              headers={"content-type": "application/json"})
            return r.status_code
        except httpx.TimeoutException:
            return "hung"
    return Counter(await asyncio.gather(*(one(i) for i in range(n))))


def pct(xs, q):
    return round(statistics.quantiles(xs, n=100)[q - 1], 4) if len(xs) >= 2 else (round(xs[0], 4) if xs else None)


async def scrape(hc, url) -> dict:
    text = (await hc.get(url + "/metrics")).text
    return {s.name: s.value for fam in text_string_to_metric_families(text) for s in fam.samples if not s.labels}


async def level(hc, args, pid, concurrency, temperature) -> dict:
    out = {"status": Counter(), "latency": [], "ttft": [], "gaps": [], "tokens": 0, "done": 0, "hung": 0,
           "errors": Counter(), "texts": defaultdict(set)}
    m0, rss0 = await scrape(hc, args.url), rss_mb(pid)
    t0 = time.monotonic()
    rngs = [random.Random(f"{concurrency}-{temperature}-{i}") for i in range(concurrency)]
    await asyncio.gather(*(stream_client(hc, args.url, t0 + args.duration, args, temperature, out, rng)
                           for rng in rngs))
    elapsed = time.monotonic() - t0
    m1, rss1 = await scrape(hc, args.url), rss_mb(pid)
    delta = lambda k: m1.get(k, 0) - m0.get(k, 0)  # noqa: E731
    row = {"concurrency": concurrency, "temperature": temperature, "duration_s": round(elapsed, 1),
           "completed": out["done"], "requests_per_s": round(out["done"] / elapsed, 3),
           "tokens_per_s": round(out["tokens"] / elapsed, 2),
           "ttft_p50_s": pct(out["ttft"], 50), "ttft_p95_s": pct(out["ttft"], 95),
           "itl_p50_s": pct(out["gaps"], 50), "itl_p95_s": pct(out["gaps"], 95),
           "latency_p50_s": pct(out["latency"], 50), "latency_p95_s": pct(out["latency"], 95),
           "rows_per_pass": round(delta("specdec_batch_rows_sum") / delta("specdec_batch_rows_count"), 2)
           if delta("specdec_batch_rows_count") else None,
           "mean_tau": round(delta("specdec_tau_sum") / delta("specdec_tau_count"), 3)
           if delta("specdec_tau_count") else None,
           "stream_status": dict(out["status"]), "stream_5xx": sum(v for k, v in out["status"].items() if k >= 500),
           "hung": out["hung"], "client_errors": dict(out["errors"]), "rss_mb_start": rss0, "rss_mb_end": rss1}
    if args.check_identity:  # every text served under load (greedy, or seeded sampling) vs the request alone
        mismatched, checked = 0, 0
        for prompt, texts in out["texts"].items():
            alone = (await one_request(hc, args.url, prompt, args.max_tokens, temperature,
                                       seed_of(prompt, temperature)))["text"]
            checked += 1
            mismatched += any(t != alone for t in texts)
        row["prompts_checked"], row["prompts_differing"] = checked, mismatched
    return row


async def main_async(args, pid, baseline=None):
    limits = httpx.Limits(max_connections=max(args.levels) + 64)
    async with httpx.AsyncClient(timeout=httpx.Timeout(args.request_timeout), limits=limits) as hc:
        rows = []
        for t in args.temperatures:
            for c in args.levels:
                for r in range(args.rounds):  # with a baseline: its window right after ours, every round
                    for name, url, server_pid in [("main", args.url, pid)] + ([("baseline", *baseline)] if baseline
                                                                              else []):
                        rows.append({"server": name, "round": r,
                                     **await level(hc, argparse.Namespace(**{**vars(args), "url": url}),
                                                   server_pid, c, t)})
                        print(json.dumps(rows[-1]), file=sys.stderr)
        burst = await malformed_burst(hc, args.url, args.malformed)
        health = (await hc.get(args.url + "/health")).status_code
    return {"levels": rows, "malformed_status": {str(k): v for k, v in burst.items()},
            "malformed_5xx": sum(v for k, v in burst.items() if isinstance(k, int) and k >= 500),
            "health_after": health, "rss_mb_after_burst": rss_mb(pid)}


def spawn(serve_args: str, src: str | None = None):
    """`specdec serve` on a free loopback port; src: a checkout whose specdec it runs (the baseline's code)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen([sys.executable, "-m", "specdec.cli", "serve", "--port", str(port), *serve_args.split()],
                            env={**os.environ, "HF_HUB_OFFLINE": "1", **({"PYTHONPATH": src} if src else {})}, cwd=src)
    url = f"http://127.0.0.1:{port}"
    for _ in range(1200):
        try:
            if httpx.get(url + "/health").status_code == 200:
                break
        except httpx.HTTPError:
            time.sleep(0.2)
    return proc, url


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--url", default=None)
    ap.add_argument("--spawn", action="store_true", help="start `specdec serve` on a free loopback port")
    ap.add_argument("--serve-args", default="--max-queue 64", help="extra args for the spawned server")
    ap.add_argument("--pid", type=int, default=None, help="server pid, for RSS")
    ap.add_argument("--levels", default="32", help="concurrency levels, comma-separated")
    ap.add_argument("--temperatures", default="0", help="comma-separated; 0 = greedy")
    ap.add_argument("--duration", type=float, default=60, help="seconds per level")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--malformed", type=int, default=500)
    ap.add_argument("--request-timeout", type=float, default=600)
    ap.add_argument("--no-identity", dest="check_identity", action="store_false",
                    help="skip serving each prompt alone after its level")
    ap.add_argument("--out", default=None, help="also write the JSON report here")
    ap.add_argument("--dashboard", default=None, metavar="PNG", help="after the levels: the server's /dashboard as "
                    "headless Chromium draws it (no API key)")
    ap.add_argument("--baseline", default=None, help="serve args of a second spawned server measured alternately")
    ap.add_argument("--baseline-src", default=None, help="a checkout (git worktree) whose code the baseline runs")
    ap.add_argument("--rounds", type=int, default=1, help="windows per level (alternating with --baseline)")
    args = ap.parse_args()
    args.levels = [int(x) for x in args.levels.split(",")]
    args.temperatures = [float(x) for x in args.temperatures.split(",")]
    proc = None
    if args.spawn:
        proc, args.url = spawn(args.serve_args)
        args.pid = proc.pid
    if not args.url:
        ap.error("give --url or --spawn")
    base = None
    if args.baseline:
        base = spawn(args.baseline, args.baseline_src)
    try:
        report = asyncio.run(main_async(args, args.pid, (base[1], base[0].pid) if base else None))
        report["serve_args"] = args.serve_args if args.spawn else None
        report["baseline_args"] = args.baseline
        report["baseline_src"] = args.baseline_src
        for t in args.temperatures:
            for c in args.levels:
                mine = [r["tokens_per_s"] for r in report["levels"] if r["server"] == "main" and r["concurrency"] == c
                        and r["temperature"] == t]
                theirs = [r["tokens_per_s"] for r in report["levels"] if r["server"] == "baseline"
                          and r["concurrency"] == c and r["temperature"] == t]
                if theirs:
                    print(f"concurrency {c}, T={t}: {sum(mine) / len(mine):.1f} vs baseline "
                          f"{sum(theirs) / len(theirs):.1f} tokens/s ({sum(mine) / sum(theirs):.2f}x)", file=sys.stderr)
        if args.dashboard:  # the server's own page, its last 10 minutes: the levels just run
            from browser import screenshot
            screenshot(args.url + "/dashboard", args.dashboard, height=1000)
        print(json.dumps(report, indent=2))
        if args.out:
            with open(args.out, "w") as f:
                json.dump(report, f, indent=2)
    finally:
        for p in [proc, base[0] if base else None]:
            if p:
                p.terminate()
                p.wait(10)


if __name__ == "__main__":
    main()
