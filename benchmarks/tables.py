"""The docs' tables from the benchmarks' JSON results: a doc marks a table with the result it shows,

    <!-- table: pair docs/pair_2026-12-04.json -->
    ...the table...
    <!-- /table -->

and `python benchmarks/tables.py docs/pair.md` writes each marked table from its JSON again (`--check`: exit 1 where
a table differs from its JSON, which tests/test_doc_tables.py runs). Kinds: `pair` (decode tokens/s per workload,
benchmarks/pair.py) and `streams` (tokens/s and time to first token per level, pair.py --streams)."""
from __future__ import annotations

import json
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
MARK = re.compile(r"(<!-- table: (\w+) (\S+) -->\n)(.*?)(<!-- /table -->)", re.S)
NAMES = {"llama": "llama-server", "ours-none": "ours `none`", "ours": "ours `ngram`", "ours-0.5b": "ours 0.5B"}
WORKLOADS = {"completion": "completion", "chat": "chat", "edits": "edits", "fim": "fill-in",
             "chat-sampled": "chat T0.7", "edits-predicted": "edits predicted", "all": "all"}


def pair_table(result: dict) -> str:
    systems = result["systems"]
    shown = [w for w in WORKLOADS if any(isinstance(c.get(w), dict) for c in systems.values())]
    lines = ["| system | " + " | ".join(WORKLOADS[w] for w in shown) + " |", "|---" * (len(shown) + 1) + "|"]
    for name, cells in systems.items():
        row = [f"{cells[w]['decode_tps']:.1f}" if isinstance(cells.get(w), dict) and cells[w].get("decode_tps")
               else "–" for w in shown]
        lines.append(f"| {NAMES.get(name, name)} | " + " | ".join(row) + " |")
    return "\n".join(lines) + "\n"


def streams_table(result: dict) -> str:
    report = result["streams"]
    levels = sorted({int(lv) for r in report.values() for lv in r})
    lines = ["| system | " + " | ".join(f"{lv} stream{'s' if lv > 1 else ''}" for lv in levels) + " | = target-only |",
             "|---" * (len(levels) + 2) + "|"]
    for name, r in report.items():
        cells = [f"{r[str(lv)]['tokens_per_s']:.1f} ({r[str(lv)]['ttft_p50_s']:.2f} s)" if str(lv) in r else "–"
                 for lv in levels]
        same = [r[lv]["identical"].split("/") for lv in r]
        own = " its own" if name.startswith("llama") else ""
        lines.append(f"| {NAMES.get(name, name)} | " + " | ".join(cells)
                     + f" | {sum(int(a) for a, _ in same)}/{sum(int(b) for _, b in same)}{own} |")
    return "\n".join(lines) + "\n"


KINDS = {"pair": pair_table, "streams": streams_table}


def render(doc: str) -> str:
    """The doc with each marked table written from its JSON again."""
    def one(m):
        kind, source = m.group(2), m.group(3)
        if kind not in KINDS:
            raise SystemExit(f"tables: unknown kind {kind!r} (choose from {', '.join(KINDS)})")
        return m.group(1) + KINDS[kind](json.loads((ROOT / source).read_text())) + m.group(5)
    return MARK.sub(one, doc)


def main(argv=None) -> int:
    args = sys.argv[1:] if argv is None else list(argv)
    check = "--check" in args
    stale = []
    for path in [Path(a) for a in args if a != "--check"]:
        doc = path.read_text()
        new = render(doc)
        if new != doc:
            stale.append(str(path))
            if not check:
                path.write_text(new)
    if check and stale:
        print(f"tables: out of step with their JSON: {', '.join(stale)} (python benchmarks/tables.py FILE)")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
