"""pair.py's concurrency mode (`--streams 1,4,8`): N clients at once against each server, level by level, the
servers in turn (the order rotating), so that drift hits each alike.

Each client sends `per_stream` prompts one after another (greedy, streamed), starting at its own offset in the
prompt set, so a level has N requests in flight from its first second to its last. A level's figures:
- aggregate tokens/s: every completion token of the level over the level's wall time;
- time to first token, p50 and p90, over its requests;
- failed requests (anything but a complete 200 stream);
- identity: each answer against the same prompt's answer from the family's target-only server (`ours-none`, or
  `llama` for llama-server's drafts) at any level: batching must change nothing.
"""
from __future__ import annotations

import statistics
import threading
import time

from pair import Refused, Server, request, settle


def run_level(server: Server, prompts: list[dict], streams: int, max_tokens: int, per_stream: int) -> dict:
    done, lock = [], threading.Lock()

    def client(c: int) -> None:
        for k in range(per_stream):
            i = (c + k * streams) % len(prompts)
            try:
                r = request(server, prompts[i], max_tokens)
                r["ok"] = r["tokens"] > 0
            except (Refused, Exception) as e:  # noqa: BLE001  a refusal or a transport error: a failed request
                r = {"ok": False, "error": f"{e.__class__.__name__}: {str(e)[:200]}"}
            with lock:
                done.append({"i": i, **r})

    t0 = time.monotonic()
    threads = [threading.Thread(target=client, args=(c,)) for c in range(streams)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.monotonic() - t0
    ok = [r for r in done if r["ok"]]
    ttft = sorted(r["ttft_s"] for r in ok)
    return {"streams": streams, "requests": len(done), "failed": len(done) - len(ok),
            "tokens_per_s": round(sum(r["tokens"] for r in ok) / wall, 2), "wall_s": round(wall, 1),
            "ttft_p50_s": round(statistics.median(ttft), 3) if ttft else None,
            "ttft_p90_s": round(ttft[min(len(ttft) - 1, int(0.9 * len(ttft)))], 3) if ttft else None,
            "answers": {r["i"]: r["text"] for r in ok}}


def concurrency(servers: dict[str, Server], prompts: list[dict], levels: list[int], max_tokens: int,
                per_stream: int, log) -> dict:
    """Each level in turn (a level named twice runs twice, its windows pooled), the servers in turn within it."""
    names = list(servers)
    runs = {n: {} for n in names}  # name -> level -> its windows
    for j, level in enumerate(levels):
        order = names[j % len(names):] + names[:j % len(names)]
        for name in order:
            r = run_level(servers[name], prompts, level, max_tokens, per_stream)
            runs[name].setdefault(level, []).append(r)
            settle(servers[name])
            log(f"{name} at {level} streams: {r['tokens_per_s']} tokens/s, TTFT p50 {r['ttft_p50_s']} s, "
                f"{r['failed']} failed")
    pooled = {n: {lv: pool(ws) for lv, ws in by.items()} for n, by in runs.items()}
    reference = {}
    for family in ("ours-none", "llama"):
        reference[family] = {i: t for lv in pooled.get(family, {}).values() for i, t in lv["answers"].items()}
    out = {}
    for n in names:
        ref = reference["llama" if n.startswith("llama") else "ours-none"]
        out[n] = {}
        for level, r in pooled[n].items():
            same = [t == ref[i] for i, t in r["answers"].items() if i in ref]
            out[n][level] = {k: v for k, v in r.items() if k != "answers"}
            out[n][level]["identical"] = f"{sum(same)}/{len(same)}"
            base = pooled.get("ours-none", {}).get(level)
            if base and n != "ours-none" and base["tokens_per_s"]:
                out[n][level]["vs_target_only"] = round(r["tokens_per_s"] / base["tokens_per_s"], 3)
    return out


def pool(windows: list[dict]) -> dict:
    """A level's windows as one: tokens over wall time, TTFT medians averaged, failures summed."""
    tokens = sum(w["tokens_per_s"] * w["wall_s"] for w in windows)
    wall = sum(w["wall_s"] for w in windows)
    mean = lambda k: round(statistics.mean(w[k] for w in windows if w[k] is not None), 3) \
        if any(w[k] is not None for w in windows) else None  # noqa: E731
    return {"streams": windows[0]["streams"], "windows": len(windows), "requests": sum(w["requests"] for w in windows),
            "failed": sum(w["failed"] for w in windows), "tokens_per_s": round(tokens / wall, 2),
            "by_window": [w["tokens_per_s"] for w in windows], "wall_s": round(wall, 1),
            "ttft_p50_s": mean("ttft_p50_s"), "ttft_p90_s": mean("ttft_p90_s"),
            "answers": {i: t for w in windows for i, t in w["answers"].items()}}


def print_streams(report: dict) -> None:
    levels = sorted({lv for r in report.values() for lv in r})
    print("| system | " + " | ".join(f"{lv} streams: tokens/s (TTFT p50 s)" for lv in levels)
          + " | failed | = target-only |")
    print("|---" * (len(levels) + 3) + "|")
    for n, r in report.items():
        cells = [f"{r[lv]['tokens_per_s']} ({r[lv]['ttft_p50_s']})" if lv in r else "–" for lv in levels]
        same = [r[lv]["identical"].split("/") for lv in r]
        print(f"| {n} | " + " | ".join(cells) + f" | {sum(r[lv]['failed'] for lv in r)} | "
              f"{sum(int(a) for a, _ in same)}/{sum(int(b) for _, b in same)} |")
