"""Time to first token on repeated prompts: requests that share a long system prompt (a document) and differ in the
question, one at a time, streamed, against `specdec serve` started as a child process. Reports the prefix cache's
hit rate (prompt tokens found / looked up, from /metrics) and the median time to first token of the first request
against the repeats.

    python benchmarks/serve.py prefix-ttft [--doc-tokens 2000] [--requests 8] [--json out.json]
    PYTHONPATH=/path/to/older/specdec python benchmarks/serve.py prefix-ttft   # an older release
"""
from __future__ import annotations

import argparse
import json
import signal
import statistics
import subprocess
import sys
import time

import httpx

from memory_waves import scrape, texts, wait_healthy

QUESTIONS = ["Which word comes first?", "Which word comes last?", "How many times does river appear?",
             "Summarise the text in one line.", "Is the word copper in it?", "Name three words it uses.",
             "What is the tenth word?", "Does it mention a harbor?", "Give the text a title.", "Which word repeats most?"]


def first_token_s(url: str, document: str, question: str) -> float:
    body = {"model": "specdec", "stream": True, "max_tokens": 8, "temperature": 0,
            "messages": [{"role": "system", "content": document}, {"role": "user", "content": question}]}
    t = time.perf_counter()
    with httpx.stream("POST", url + "/v1/chat/completions", json=body, timeout=600) as r:
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                delta = json.loads(line[6:])["choices"][0].get("delta", {})
                if delta.get("content"):
                    return time.perf_counter() - t
    return float("nan")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--doc-tokens", type=int, default=2000)
    ap.add_argument("--requests", type=int, default=8)
    ap.add_argument("--port", type=int, default=8766)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    from specdec import models
    _, tok = models.load("default", backend="runtime")
    document = texts(tok, 7, 1, args.doc_tokens)[0]
    server = subprocess.Popen([sys.executable, "-m", "specdec.cli", "serve", "--port", str(args.port)],
                              stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{args.port}"
    try:
        wait_healthy(url)
        ttft = [first_token_s(url, document, QUESTIONS[i % len(QUESTIONS)]) for i in range(args.requests)]
        m = scrape(url)
    finally:
        server.send_signal(signal.SIGINT)
        server.wait(timeout=60)
    queries, hits = m.get("vllm:prefix_cache_queries_total", 0), m.get("vllm:prefix_cache_hits_total", 0)
    report = {"doc_tokens": args.doc_tokens, "ttft_s": [round(x, 3) for x in ttft],
              "first_s": round(ttft[0], 3), "repeat_median_s": round(statistics.median(ttft[1:]), 3),
              "prefix_queries": queries, "prefix_hits": hits, "hit_rate": round(hits / queries, 3) if queries else None}
    print(report)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
