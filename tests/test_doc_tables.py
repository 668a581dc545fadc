"""The docs' tables are their JSON results' (benchmarks/docs.py tables): a marked table that no longer matches the result
it names fails here, so a rerun's numbers reach the docs through the script, not by hand."""
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks" / "suite"))

import tables  # noqa: E402


def test_every_marked_table_is_its_json():
    marked = [p for p in tables.DOCS if "<!-- table:" in p.read_text()]
    assert len(marked) >= 8 and tables.main(["--check"]) == 0


def test_a_table_out_of_step_is_caught_and_rewritten(tmp_path, capsys):
    doc = tmp_path / "d.md"
    right = tables.render((ROOT / "docs" / "pair.md").read_text())
    doc.write_text(right.replace("| ours 0.5B | 94.9 |", "| ours 0.5B | 99.9 |"))
    assert tables.main(["--check", str(doc)]) == 1 and "out of step" in capsys.readouterr().out
    assert tables.main([str(doc)]) == 0 and doc.read_text() == right


def test_a_missing_doc_or_result_is_one_line_and_help_prints_the_usage(tmp_path, capsys):
    assert tables.main([str(tmp_path / "missing.md")]) == 2
    assert capsys.readouterr().err.strip() == f"tables: {tmp_path / 'missing.md'}: No such file or directory"
    doc = tmp_path / "d.md"
    doc.write_text("<!-- table: pair docs/no_such_result.json -->\n<!-- /table -->\n")
    assert tables.main([str(doc)]) == 2 and len(capsys.readouterr().err.strip().splitlines()) == 1
    assert tables.main(["-h"]) == 0 and "<!-- table:" in capsys.readouterr().out


def test_the_readme_stays_a_users_page():
    """At most 12,000 characters, with exactly the two set-up commands (history and recipes go in docs/)."""
    text = (ROOT / "README.md").read_text()
    setups = [line for line in text.splitlines() if line.startswith("python3 -m venv .venv")]
    assert len(text) <= 12_000 and len(setups) == 2
    assert 'pip install -e ".[test]"' in setups[1] and setups[1].endswith("python -m pytest -q")


def test_a_bound_the_run_did_not_measure_is_shown_as_none():
    """A sampled workload whose acceptance the run did not measure has no bound at its α: the table shows "–", not
    the bound at α = 1 beside "α 0.00" (docs/pair_wide_2026-12-07.json's 0.5B on sampled chat)."""
    from table_kinds import pair_bounds_table
    result = {"bounds": {"ours-0.5b": {"draft_step": 0.235, "chat-sampled": {
        "measured": 1.15, "alpha": 0.0, "copy": 1.01, "copy+model": 2.67, "copy+model@alpha": None}}},
        "config": {"commands": {"ours-0.5b": ["specdec", "serve", "--draft", "coder05.gguf"]}}}
    row = pair_bounds_table(result).splitlines()[-1]
    assert row.endswith("| 1.15 \\| – |") and "2.67" not in row
