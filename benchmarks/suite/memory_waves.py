"""Long prompts against `specdec serve` with a KV budget: does the server's memory stay bounded, and does every
request get either its answer or a quick 429?

It starts `specdec serve --kv-memory GIB --max-queue 64` as a child process, then sends:
1. `--first` concurrent completions (greedy) of ~`--tokens`-token prompts, `max_tokens` 16;
2. 4 more with texts the first step answered, but a different last word (prefix-cache hits);
3. `--waves` waves of 4, each with fresh texts.
After each step: status codes, the slowest request, resident memory (now and peak, /proc), and the server's KV and
prefix-cache figures from /metrics. Then the server stops, and every 200 answer is compared with the same request
served alone (the target alone, greedy, in this process).

    python benchmarks/serve.py memory-waves [--kv-memory 1.5] [--tokens 7800] [--first 16] [--waves 5] [--json out.json]
    PYTHONPATH=/path/to/older/specdec python benchmarks/serve.py memory-waves --no-kv-flag   # an older release
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import subprocess
import sys
import time

import httpx

WORDS = ("alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu nu xi omicron pi rho sigma tau upsilon "
         "phi chi psi omega river stone cloud maple harbor lantern copper meadow violet thunder").split()


def texts(tok, seed: int, count: int, tokens: int) -> list[str]:
    """`count` texts of random words, each about `tokens` tokens long."""
    out = []
    for i in range(count):
        r = random.Random(seed * 1000 + i)
        words = [r.choice(WORDS) for _ in range(tokens)]
        n = len(tok(" ".join(words), add_special_tokens=False).input_ids)
        out.append(" ".join(words[: int(len(words) * tokens / n)]))
    return out


def memory(pid: int) -> tuple[int, int]:
    """(VmRSS, VmHWM) of `pid` in MB."""
    fields = dict(line.split(":", 1) for line in open(f"/proc/{pid}/status"))
    return int(fields["VmRSS"].split()[0]) // 1024, int(fields["VmHWM"].split()[0]) // 1024


def wait_healthy(url: str, tries: int = 600) -> None:
    """Until the server answers /health (it measures its pass curve at start)."""
    for _ in range(tries):
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            time.sleep(1)


def scrape(url: str) -> dict:
    want = ("vllm:kv_cache_usage_perc", "specdec_kv_cache_bytes", "vllm:num_preemptions_total",
            "vllm:prefix_cache_queries_total", "vllm:prefix_cache_hits_total", "specdec_requests_refused_total")
    out = {}
    for line in httpx.get(url + "/metrics", timeout=30).text.splitlines():
        name, _, value = line.partition(" ")
        if name in want:
            out[name] = float(value)
    return out


async def step(url: str, prompts: list[str]) -> list[dict]:
    async def one(hc, prompt):
        t = time.perf_counter()
        r = await hc.post(url + "/v1/completions", json={"model": "specdec", "prompt": prompt, "max_tokens": 16,
                                                         "temperature": 0})
        body = r.json()
        return {"status": r.status_code, "s": round(time.perf_counter() - t, 1),
                "text": body["choices"][0]["text"] if r.status_code == 200 else None,
                "retry_after": r.headers.get("retry-after")}
    async with httpx.AsyncClient(timeout=900) as hc:
        return await asyncio.gather(*(one(hc, p) for p in prompts))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--kv-memory", type=float, default=1.5)
    ap.add_argument("--no-kv-flag", action="store_true", help="a release without --kv-memory")
    ap.add_argument("--tokens", type=int, default=7800)
    ap.add_argument("--first", type=int, default=16)
    ap.add_argument("--waves", type=int, default=5)
    ap.add_argument("--port", type=int, default=8765)
    ap.add_argument("--timeout", type=float, default=300.0, help="the server's request timeout (s)")
    ap.add_argument("--no-check", action="store_true", help="skip the comparison with requests served alone")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()

    from specdec import SpecDecoder, models
    _, tok = models.load("default", backend="runtime")
    first = texts(tok, 1, args.first, args.tokens)
    plan = [("first", first), ("same texts, new last word", None)]  # (texts the first step answered)
    plan += [(f"wave {w + 1}", texts(tok, 100 + w, 4, args.tokens)) for w in range(args.waves)]
    del tok

    cmd = [sys.executable, "-m", "specdec.cli", "serve", "--max-queue", "64", "--port", str(args.port),
           "--timeout", str(args.timeout)]
    if not args.no_kv_flag:
        cmd += ["--kv-memory", str(args.kv_memory)]
    server = subprocess.Popen(cmd, stderr=subprocess.PIPE if not os.environ.get("SHOW_SERVER") else None, text=True)
    url = f"http://127.0.0.1:{args.port}"
    try:
        wait_healthy(url)
        rss, _ = memory(server.pid)
        rows = [{"step": "start", "rss_mb": rss, "peak_mb": rss}]
        print(rows[0], flush=True)
        sent = []
        for name, prompts in plan:
            if prompts is None:
                prompts = [p + " finally" for p, g in sent if g["status"] == 200][:4]
            got = asyncio.run(step(url, prompts))
            rss, peak = memory(server.pid)
            codes = {}
            for g in got:
                codes[g["status"]] = codes.get(g["status"], 0) + 1
            rows.append({"step": name, "requests": len(prompts), "codes": codes,
                         "slowest_s": max(g["s"] for g in got), "rss_mb": rss, "peak_mb": peak,
                         "retry_after": sorted({g["retry_after"] for g in got if g["retry_after"]}), **scrape(url)})
            sent += [(p, g) for p, g in zip(prompts, got)]
            print(rows[-1], flush=True)
    finally:
        server.send_signal(signal.SIGINT)
        try:
            _, err = server.communicate(timeout=60)
            err = err or ""
        except subprocess.TimeoutExpired:
            server.kill()
            _, err = server.communicate()
    banner = next((line for line in err.splitlines() if "KV cache" in line), None)
    report = {"kv_memory_gib": None if args.no_kv_flag else args.kv_memory, "banner": banner, "steps": rows}
    if not args.no_check:  # each answer against the target alone, greedy
        sd = SpecDecoder(draft="none")
        answered = [(p, g) for p, g in sent if g["status"] == 200]
        differ = sum(sd.generate(p, max_new_tokens=16, chat=False).text != g["text"] for p, g in answered)
        report["checked"], report["differing"] = len(answered), differ
        print(f"{len(answered)} answers checked against the request alone: {differ} differ", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
