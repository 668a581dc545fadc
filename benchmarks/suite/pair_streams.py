"""pair.py's concurrency mode (`--streams 1,4,8`): N clients at once against each server, level by level, the
servers in turn (the order rotating), so that drift hits each alike.

Each client sends `per_stream` prompts one after another (greedy, streamed), starting at its own offset in the
prompt set, so a level has N requests in flight from its first second to its last. A level's figures:
- aggregate tokens/s: every completion token of the level over the level's wall time;
- tokens/s while all N streams were busy (all_busy): up to the moment the first stream ran out of prompts, what a
  server under steady load delivers, without the window's tail where finished streams wait for the slowest;
- time to first token, p50 and p90, over its requests;
- failed requests (anything but a complete 200 stream), and what each failure was;
- over target-only, window by window (a level named n times: `--streams 8,8,8,8`): each rotation's ratio to
  target-only's window beside it, their geometric mean and its 95% interval. Pooled windows mix moments of a machine
  whose speed drifts by a third within minutes; a claim "not below target-only" needs the interval, not one ratio;
- identity: each answer against the same prompt's answer from the family's target-only server (`ours-none`, or
  `llama` for llama-server's drafts) at any level: batching must change nothing;
- why (specdec's servers, from /metrics over the level): passes, rows per pass, the share of passes with more rows
  than the level has streams (draft rows bought), draft tokens and their acceptance, and the ms per pass spent
  drafting and verifying, and the split's hindsight at that load (accepted / expected, batch/hindsight.py). A
  draft that loses throughput shows here whether its rows or its drafting cost it.
"""
from __future__ import annotations

import math
import statistics
import threading
import time

import httpx
from prometheus_client.parser import text_string_to_metric_families

from pair import Refused, Server, request, settle

def scrape(server: Server) -> dict[tuple[str, str], float] | None:
    """specdec's /metrics samples by (name, `le` bucket or `decoding` level); None for a server without them
    (llama-server)."""
    if server.name.startswith("llama"):
        return None
    try:
        text = httpx.get(server.url + "/metrics", timeout=10).text
    except httpx.HTTPError:
        return None
    return {(s.name, s.labels.get("le", s.labels.get("decoding", ""))): s.value
            for f in text_string_to_metric_families(text) for s in f.samples if not set(s.labels) - {"le", "decoding"}}


def counts(before: dict | None, after: dict | None, streams: int) -> dict | None:
    """A level's raw /metrics deltas: passes, rows, passes within the streams' rows, drafted, accepted, seconds."""
    if before is None or after is None:
        return None
    d = {k: after.get(k, 0.0) - before.get(k, 0.0) for k in after}
    one = lambda name: d.get((name, ""), 0.0)  # noqa: E731
    buckets = [(float(le), v) for (n, le), v in d.items() if n == "specdec_batch_rows_bucket" and le != "+Inf"]
    return {"passes": one("specdec_batch_rows_count"), "rows": one("specdec_batch_rows_sum"),
            "within": max((v for le, v in buckets if le <= streams), default=0.0),  # (buckets 1,2,4,8,12,...)
            "drafted": one("specdec_draft_tokens_total"), "accepted": one("specdec_accepted_tokens_total"),
            "draft_s": one("specdec_draft_seconds_sum"), "verify_s": one("specdec_verify_seconds_sum"),
            "hindsight": after.get(("specdec_draft_hindsight", "8+" if streams >= 8 else "4-7" if streams >= 4 else
                                    "2-3" if streams >= 2 else "1"))}  # (a gauge: where the window left it)


def why(raw: list[dict | None]) -> dict | None:
    """What a level's passes were made of, over its windows (the module's docstring)."""
    if not raw or any(r is None for r in raw):
        return None
    t = {k: sum(r[k] for r in raw) for k in raw[0] if k != "hindsight"}
    if not t["passes"]:
        return None
    per_pass = lambda k: round(1e3 * t[k] / t["passes"], 2)  # noqa: E731
    return {"passes": int(t["passes"]), "rows_per_pass": round(t["rows"] / t["passes"], 2),
            "passes_over_streams": round(1 - t["within"] / t["passes"], 3), "drafted": int(t["drafted"]),
            "accepted": round(t["accepted"] / t["drafted"], 3) if t["drafted"] else None,
            "draft_ms_per_pass": per_pass("draft_s"), "verify_ms_per_pass": per_pass("verify_s"),
            "hindsight": None if raw[-1]["hindsight"] is None else round(raw[-1]["hindsight"], 3)}


def run_level(server: Server, prompts: list[dict], streams: int, max_tokens: int, per_stream: int) -> dict:
    done, lock = [], threading.Lock()

    def client(c: int) -> None:
        for k in range(per_stream):
            i = (c + k * streams) % len(prompts)
            try:
                r = request(server, prompts[i], max_tokens, timeline=True)
                r["ok"] = r["tokens"] > 0
            except (Refused, Exception) as e:  # noqa: BLE001  a refusal or a transport error: a failed request
                r = {"ok": False, "error": f"{e.__class__.__name__}: {str(e)[:200]}"}
            with lock:
                done.append({"i": i, "stream": c, **r})

    before = scrape(server)
    t0 = time.monotonic()
    threads = [threading.Thread(target=client, args=(c,)) for c in range(streams)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.monotonic() - t0
    after = scrape(server)
    ok = [r for r in done if r["ok"]]
    ttft = sorted(r["ttft_s"] for r in ok)
    busy_tokens, busy_s = all_busy(ok, t0, streams)
    return {"streams": streams, "requests": len(done), "failed": len(done) - len(ok),
            "tokens_per_s": round(sum(r["tokens"] for r in ok) / wall, 2), "wall_s": round(wall, 1),
            "busy_tokens_per_s": round(busy_tokens / busy_s, 2) if busy_s > 0 else None, "busy_s": round(busy_s, 2),
            "ttft_p50_s": round(statistics.median(ttft), 3) if ttft else None,
            "ttft_p90_s": round(ttft[min(len(ttft) - 1, int(0.9 * len(ttft)))], 3) if ttft else None,
            "counts": counts(before, after, streams), "answers": {r["i"]: r["text"] for r in ok},
            "errors": sorted({r.get("error", "no tokens") for r in done if not r["ok"]})}


def all_busy(requests: list[dict], t0: float, streams: int) -> tuple[float, float]:
    """Tokens delivered while every stream had a request in flight, and for how long: from the level's start to
    the moment the first stream ran out of prompts (its last answer's end). A request in flight then counts the
    share of its text that had arrived (its tokens x characters received / characters in all): the answers are
    the same text on every system (checked by `identical`), so that share means the same tokens on each.

    A level's wall time also holds its tail, where streams that finished wait for the slowest: a draft that speeds
    some answers more than others spends more of the window at fewer streams, where a pass carries fewer rows, and
    the window's tokens/s falls with it though every pass delivered more (docs/serving.md). A server under steady
    load has no such tail: this is its throughput."""
    ends = {}
    for r in requests:
        ends[r["stream"]] = max(ends.get(r["stream"], 0.0), r["timeline"]["end"])
    if len(ends) < streams:  # a stream with no answer at all: never busy the whole time
        return 0.0, 0.0
    until = min(ends.values())
    tokens = 0.0
    for r in requests:
        pieces = r["timeline"]["pieces"]
        total = sum(n for _, n in pieces)
        if total:
            tokens += r["tokens"] * sum(n for t, n in pieces if t <= until) / total
    return tokens, until - t0


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
                f"{r['failed']} failed" + (f" ({'; '.join(r['errors'])})" if r["errors"] else ""))
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
                paired_ratio = paired(runs[n][level], runs["ours-none"][level])
                if paired_ratio:
                    out[n][level]["vs_target_only_paired"] = paired_ratio
                busy_ratio = paired(runs[n][level], runs["ours-none"][level], "busy_tokens_per_s")
                if busy_ratio:
                    out[n][level]["vs_target_only_all_busy"] = busy_ratio
    return out


def paired(mine: list[dict], base: list[dict], key: str = "tokens_per_s") -> dict | None:
    """A system's tokens/s (`key`: over the window, or while all streams were busy) over target-only's, window by
    window of the same rotation (the two ran within a minute of each other; this machine's speed drifts by a third
    within minutes, and pooled windows mix those moments): the geometric mean of the ratios and its 95% interval
    (Student's t on their logs), with two rotations or more."""
    ratios = [a[key] / b[key] for a, b in zip(mine, base) if a.get(key) and b.get(key)]
    if len(ratios) < 2:
        return None
    logs = [math.log(x) for x in ratios]
    mean, half = statistics.mean(logs), T95[min(len(logs) - 1, len(T95)) - 1] * statistics.stdev(logs) / math.sqrt(len(logs))
    return {"ratio": round(math.exp(mean), 3), "ci95": [round(math.exp(mean - half), 3), round(math.exp(mean + half), 3)],
            "rotations": len(ratios), "by_rotation": [round(x, 3) for x in ratios]}


T95 = (12.71, 4.30, 3.18, 2.78, 2.57, 2.45, 2.36, 2.31, 2.26, 2.23, 2.20, 2.18, 2.16, 2.14, 2.13, 2.12)  # t(0.975, df)
# (df 1..16; beyond 16 the last one, 2.12, is within 6% of the normal's 1.96)


def pool(windows: list[dict]) -> dict:
    """A level's windows as one: tokens over wall time, TTFT medians averaged, failures summed."""
    tokens = sum(w["tokens_per_s"] * w["wall_s"] for w in windows)
    wall = sum(w["wall_s"] for w in windows)
    busy = [w for w in windows if w.get("busy_tokens_per_s")]
    busy_s = sum(w["busy_s"] for w in busy)
    mean = lambda k: round(statistics.mean(w[k] for w in windows if w[k] is not None), 3) \
        if any(w[k] is not None for w in windows) else None  # noqa: E731
    return {"streams": windows[0]["streams"], "windows": len(windows), "requests": sum(w["requests"] for w in windows),
            "failed": sum(w["failed"] for w in windows),
            "errors": sorted({e for w in windows for e in w["errors"]}), "tokens_per_s": round(tokens / wall, 2),
            "by_window": [w["tokens_per_s"] for w in windows], "wall_s": round(wall, 1),
            "busy_tokens_per_s": round(sum(w["busy_tokens_per_s"] * w["busy_s"] for w in busy) / busy_s, 2)
            if busy_s else None, "busy_share": round(busy_s / wall, 3) if wall else None,
            "ttft_p50_s": mean("ttft_p50_s"), "ttft_p90_s": mean("ttft_p90_s"),
            "why": why([w["counts"] for w in windows]),
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
    pairs = [(n, lv, r[lv]["vs_target_only_paired"]) for n, r in report.items() for lv in sorted(r)
             if r[lv].get("vs_target_only_paired")]
    if pairs:
        print("\n| system | streams | over target-only, window by window: ratio (95% interval) | while all streams "
              "were busy | rotations |\n" + "|---" * 5 + "|")
    for n, lv, p in pairs:
        b = report[n][lv].get("vs_target_only_all_busy")
        busy = f"{b['ratio']} ({b['ci95'][0]}-{b['ci95'][1]})" if b else "–"
        print(f"| {n} | {lv} | {p['ratio']} ({p['ci95'][0]}-{p['ci95'][1]}) | {busy} | {p['rotations']} |")
    rows = [(n, lv, r[lv]["why"]) for n, r in report.items() for lv in sorted(r) if r[lv].get("why")]
    if rows:
        print("\n| system | streams | passes | rows/pass | passes above streams rows | drafted | accepted "
              "| draft ms/pass | verify ms/pass |\n" + "|---" * 9 + "|")
    for n, lv, w in rows:
        print(f"| {n} | {lv} | {w['passes']} | {w['rows_per_pass']} | {w['passes_over_streams']:.0%} | "
              f"{w['drafted']} | {w['accepted'] if w['accepted'] is not None else '–'} | {w['draft_ms_per_pass']} | "
              f"{w['verify_ms_per_pass']} |")
