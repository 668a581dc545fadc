"""One JSON line per target pass a batch engine runs (`specdec serve --pass-log FILE`): what the pass carried, what it
cost against what the curve priced it at, and what its drafts bought. A trace (--trace-dir) follows one request;
this follows the server, where a draft's cost and saving at a load show.

Fields: rows (all of the pass), prompt_rows (prompt chunks' share), decoding (requests emitting a token), draft_rows,
accepted (draft tokens kept), tree (any request verified a token tree), verify_ms (the pass), priced_ms (the curve's
price for its rows when it was planned), before_ms (planning and drafting), after_ms (verification and bookkeeping),
t (monotonic seconds at its end).

`by_load` groups them by decoding requests (1, 2-3, 4-7, 8+) into tokens delivered per second of the server's time
and each load's share of the tokens: a draft can deliver more at every load and still less in all, where it leaves
the server at low loads for longer (a closed set of requests' tail, where finished streams wait for the slowest).

`summary` groups the passes by what they carried (no drafts; chains or trees, where at most 4 or more requests
decoded; with prompt chunks or not) and prices each group's drafts on the curve: what their accepted tokens would
have cost target-only (T(base rows) / decoding each) less what their rows added to the pass (T(rows) − T(base
rows)) and their drafting beyond `baseline_ms` a pass (target-only's own bookkeeping).
"""
from __future__ import annotations

import contextlib
import json
import sys
import threading
from collections import defaultdict
from collections.abc import Callable

FIELDS = ("rows", "prompt_rows", "decoding", "draft_rows", "accepted", "tree", "verify_ms", "priced_ms", "before_ms",
          "after_ms", "t")


class PassLog:
    """Appends a pass's record as a JSON line (line-buffered: a stopped server leaves whole lines). A write that
    fails (a full disk) says so once on stderr and ends the log; it never fails a pass."""

    def __init__(self, path: str):
        self.path = path
        self._file = open(path, "a", buffering=1, encoding="utf-8")  # noqa: SIM115 (open for the server's life)
        self._lock = threading.Lock()

    def __call__(self, record: dict) -> None:
        line = json.dumps({k: round(v, 3) if isinstance(v, float) else v for k, v in record.items()})
        with self._lock:
            if self._file.closed:
                return
            try:
                self._file.write(line + "\n")
            except OSError as e:
                print(f"specdec: the pass log {self.path} stopped: {e}", file=sys.stderr)
                with contextlib.suppress(OSError):
                    self._file.close()

    def close(self) -> None:
        with self._lock:
            self._file.close()


def read(path: str) -> list[dict]:
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def group(r: dict) -> str:
    """A pass's kind: `none`, or `chain`/`tree` by decoding requests (`≤4`, `>4`), each `+prompt` with chunks."""
    kind = "none" if not r["draft_rows"] else f"{'tree' if r['tree'] else 'chain'} {'≤4' if r['decoding'] <= 4 else '>4'}"
    return kind + (" +prompt" if r["prompt_rows"] else "")


def summary(records: list[dict], pass_ms: Callable[[float], float], baseline_ms: float = 0.0) -> dict[str, dict]:
    """Per group (`group`): passes, draft rows, accepted, mean verify / priced, ms a pass outside the pass, and the
    drafts' net saving in ms priced on `pass_ms` (the module's docstring)."""
    out = defaultdict(lambda: {"passes": 0, "draft_rows": 0, "accepted": 0, "verify_over_priced": 0.0,
                               "outside_ms": 0.0, "saved_ms": 0.0})
    for r in records:
        g = out[group(r)]
        base = r["rows"] - r["draft_rows"]
        token_ms = pass_ms(base) / max(1, r["decoding"])
        outside = r["before_ms"] + r["after_ms"]
        g["passes"] += 1
        g["draft_rows"] += r["draft_rows"]
        g["accepted"] += r["accepted"]
        g["verify_over_priced"] += r["verify_ms"] / max(r["priced_ms"], 1e-9)
        g["outside_ms"] += outside
        g["saved_ms"] += r["accepted"] * token_ms - (pass_ms(r["rows"]) - pass_ms(base)) - (outside - baseline_ms)
    for g in out.values():
        g["verify_over_priced"] = round(g["verify_over_priced"] / g["passes"], 3)
        g["outside_ms"] = round(g["outside_ms"] / g["passes"], 2)
        g["saved_ms"] = round(g["saved_ms"])
    return dict(sorted(out.items()))


LOADS = ((1, 1), (2, 3), (4, 7), (8, None))  # decoding requests: 1, 2-3, 4-7, 8+


def by_load(records: list[dict]) -> dict[str, dict]:
    """Per load (LOADS, passes that decoded nothing left out): passes, tokens (decoded + accepted), seconds (the
    pass and outside it), tokens a second, and the load's share of all tokens."""
    out = {}
    for low, high in LOADS:
        rs = [r for r in records if r["decoding"] >= low and (high is None or r["decoding"] <= high)]
        if rs:
            tokens = sum(r["decoding"] + r["accepted"] for r in rs)
            s = sum(r["verify_ms"] + r["before_ms"] + r["after_ms"] for r in rs) / 1e3
            out[f"{low}" if low == high else f"{low}+" if high is None else f"{low}-{high}"] = {
                "passes": len(rs), "tokens": tokens, "s": round(s, 2), "tokens_per_s": round(tokens / s, 1) if s else None}
    total = sum(g["tokens"] for g in out.values())
    for g in out.values():
        g["share"] = round(g["tokens"] / total, 3) if total else None
    return out
