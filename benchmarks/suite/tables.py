"""The docs' tables from the benchmarks' JSON results: a doc marks a table with the result it shows,

    <!-- table: pair docs/pair_2026-12-04.json -->
    ...the table...
    <!-- /table -->

and `python benchmarks/docs.py tables docs/pair.md` writes each marked table from its JSON again (`--check`: exit 1 where
a table differs from its JSON, which tests/test_doc_tables.py runs). A marker may name several results (the README's
table reads two). The kinds, one function each, are in table_kinds.py. With no file named, every doc is written."""
from __future__ import annotations

import json
import re
import sys
from pathlib import Path

from table_kinds import KINDS

ROOT = Path(__file__).resolve().parents[2]
MARK = re.compile(r"(<!-- table: (\w+) ([^>]+?) -->\n)(.*?)(<!-- /table -->)", re.S)
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def render(doc: str) -> str:
    """The doc with each marked table written from its JSON again."""
    def one(m):
        kind, sources = m.group(2), m.group(3).split()
        if kind not in KINDS:
            raise SystemExit(f"tables: unknown kind {kind!r} (choose from {', '.join(KINDS)})")
        return m.group(1) + KINDS[kind](*(json.loads((ROOT / s).read_text()) for s in sources)) + m.group(5)
    return MARK.sub(one, doc)


def main(argv=None) -> int:
    args = sys.argv[1:] if argv is None else list(argv)
    if {"-h", "--help"} & set(args):
        print(__doc__)
        return 0
    check = "--check" in args
    stale = []
    for path in [Path(a) for a in args if a != "--check"] or DOCS:
        try:
            doc = path.read_text()
            new = render(doc)
        except (OSError, ValueError) as e:  # a missing doc or result, or a result that is not JSON: one line
            print(f"tables: {path}: {e.strerror if isinstance(e, OSError) else e}", file=sys.stderr)
            return 2
        if new != doc:
            stale.append(str(path))
            if not check:
                path.write_text(new)
    if check and stale:
        print(f"tables: out of step with their JSON: {', '.join(stale)} (python benchmarks/docs.py tables FILE)")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
