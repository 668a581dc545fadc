"""Load test for `specdec serve` on loopback: N concurrent streaming clients for a bounded time, then a burst of
malformed requests. Reports requests/s, tokens/s, p50/p95 time-to-first-token and latency, errors by status,
hung connections, and the server's RSS before and after.

    python benchmarks/load.py --spawn --concurrency 32 --duration 60 --malformed 500
    python benchmarks/load.py --url http://127.0.0.1:8000 --pid SERVER_PID
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
from collections import Counter

import httpx

PROMPTS = ["What is a linked list?", "Give me two tips for focus.", "Why do cats purr?", "Explain recursion briefly.",
           "Write a haiku about rain.", "What is the boiling point of water?"]
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


async def stream_client(hc: httpx.AsyncClient, url: str, stop_at: float, max_tokens: int, out: dict):
    while time.monotonic() < stop_at:
        body = {"messages": [{"role": "user", "content": random.choice(PROMPTS)}], "max_tokens": max_tokens,
                "temperature": 0, "stream": True, "stream_options": {"include_usage": True}}
        t0, ttft, tokens = time.monotonic(), None, 0
        try:
            async with hc.stream("POST", url + "/v1/chat/completions", json=body) as r:
                out["status"][r.status_code] += 1
                if r.status_code != 200:
                    await r.aread()
                    await asyncio.sleep(0.2)  # back off on 429
                    continue
                async for line in r.aiter_lines():
                    if not line.startswith("data: ") or line == "data: [DONE]":
                        continue
                    data = json.loads(line[6:])
                    if data.get("usage"):
                        tokens = data["usage"]["completion_tokens"]
                    elif data.get("choices") and data["choices"][0]["delta"].get("content") and ttft is None:
                        ttft = time.monotonic() - t0
            out["latency"].append(time.monotonic() - t0)
            out["ttft"].append(ttft if ttft is not None else time.monotonic() - t0)
            out["tokens"] += tokens
            out["done"] += 1
        except httpx.TimeoutException:
            out["hung"] += 1
        except httpx.HTTPError as e:
            out["errors"][type(e).__name__] += 1


async def malformed_burst(hc: httpx.AsyncClient, url: str, n: int) -> Counter:
    async def one(i):
        try:
            r = await hc.post(url + "/v1/chat/completions", content=MALFORMED[i % len(MALFORMED)],
                              headers={"content-type": "application/json"})
            return r.status_code
        except httpx.TimeoutException:
            return "hung"
    return Counter(await asyncio.gather(*(one(i) for i in range(n))))


def pct(xs, q):
    return round(statistics.quantiles(xs, n=100)[q - 1], 3) if len(xs) >= 2 else (round(xs[0], 3) if xs else None)


async def main_async(args, pid):
    out = {"status": Counter(), "latency": [], "ttft": [], "tokens": 0, "done": 0, "hung": 0, "errors": Counter()}
    limits = httpx.Limits(max_connections=args.concurrency + 64)
    async with httpx.AsyncClient(timeout=httpx.Timeout(args.request_timeout), limits=limits) as hc:
        rss0 = rss_mb(pid)
        t0 = time.monotonic()
        stop_at = t0 + args.duration
        await asyncio.gather(*(stream_client(hc, args.url, stop_at, args.max_tokens, out)
                               for _ in range(args.concurrency)))
        elapsed = time.monotonic() - t0
        rss1 = rss_mb(pid)
        burst = await malformed_burst(hc, args.url, args.malformed)
        health = (await hc.get(args.url + "/health")).status_code
        rss2 = rss_mb(pid)
    return {
        "concurrency": args.concurrency, "duration_s": round(elapsed, 1), "completed": out["done"],
        "requests_per_s": round(out["done"] / elapsed, 3), "tokens_per_s": round(out["tokens"] / elapsed, 2),
        "ttft_p50_s": pct(out["ttft"], 50), "ttft_p95_s": pct(out["ttft"], 95),
        "latency_p50_s": pct(out["latency"], 50), "latency_p95_s": pct(out["latency"], 95),
        "stream_status": dict(out["status"]), "stream_5xx": sum(v for k, v in out["status"].items() if k >= 500),
        "hung": out["hung"], "client_errors": dict(out["errors"]),
        "malformed_status": {str(k): v for k, v in burst.items()},
        "malformed_5xx": sum(v for k, v in burst.items() if isinstance(k, int) and k >= 500),
        "health_after": health, "rss_mb_start": rss0, "rss_mb_after_load": rss1, "rss_mb_after_burst": rss2,
    }


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--url", default=None)
    ap.add_argument("--spawn", action="store_true", help="start `specdec serve` on a free loopback port")
    ap.add_argument("--serve-args", default="--max-queue 64", help="extra args for the spawned server")
    ap.add_argument("--pid", type=int, default=None, help="server pid, for RSS")
    ap.add_argument("--concurrency", type=int, default=32)
    ap.add_argument("--duration", type=float, default=60)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--malformed", type=int, default=500)
    ap.add_argument("--request-timeout", type=float, default=600)
    args = ap.parse_args()
    proc = None
    if args.spawn:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        proc = subprocess.Popen([sys.executable, "-m", "specdec.cli", "serve", "--port", str(port),
                                 *args.serve_args.split()], env={**os.environ, "HF_HUB_OFFLINE": "1"})
        args.url, args.pid = f"http://127.0.0.1:{port}", proc.pid
        for _ in range(600):
            try:
                if httpx.get(args.url + "/health").status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.2)
    if not args.url:
        ap.error("give --url or --spawn")
    try:
        print(json.dumps(asyncio.run(main_async(args, args.pid)), indent=2))
    finally:
        if proc:
            proc.terminate()
            proc.wait(10)


if __name__ == "__main__":
    main()
