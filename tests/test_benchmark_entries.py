"""The benchmarks' entry points (benchmarks/pair.py, serve.py, runtime.py, draft.py, docs.py): each subcommand runs
one module of benchmarks/suite/, every module there is a subcommand or a helper one imports, and a wrong subcommand
is one line and exit 2."""
import ast
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
BENCH = ROOT / "benchmarks"
ENTRIES = ["pair", "serve", "runtime", "draft", "docs"]
HELPERS = {"entry.py", "browser.py", "pair_streams.py", "table_kinds.py"}


def commands(entry: str) -> dict[str, str]:
    tree = ast.parse((BENCH / f"{entry}.py").read_text())
    assign = next(n for n in tree.body if isinstance(n, ast.Assign) and n.targets[0].id == "COMMANDS")
    return ast.literal_eval(assign.value)


def test_every_suite_module_is_a_subcommand_or_a_helper():
    named = {m for e in ENTRIES for m in commands(e).values()}
    assert all((BENCH / "suite" / m).exists() for m in named)
    present = {p.name for p in (BENCH / "suite").iterdir() if p.suffix in (".py", ".sh")}
    assert present - named == HELPERS
    imported = " ".join((BENCH / "suite" / m).read_text() for m in named)
    assert all(f"import {h[:-3]}" in imported or f"from {h[:-3]} import" in imported
               for h in HELPERS - {"entry.py"})


def run(*args):
    return subprocess.run([sys.executable, *args], capture_output=True, text=True, cwd=ROOT, timeout=60)


def test_an_entry_lists_its_subcommands_and_runs_one():
    listed = run("benchmarks/serve.py")
    assert listed.returncode == 0 and all(f"  {c} " in listed.stdout for c in commands("serve"))
    helped = run("benchmarks/pair.py", "bounds", "-h")
    assert helped.returncode == 0 and helped.stdout.startswith("usage: pair.py bounds")
    assert run("benchmarks/docs.py", "tables", "--check").returncode == 0


def test_a_wrong_subcommand_is_one_line_and_exit_2():
    wrong = run("benchmarks/runtime.py", "nope")
    assert wrong.returncode == 2 and wrong.stdout == "" and len(wrong.stderr.splitlines()) == 1
    assert "unknown subcommand 'nope'" in wrong.stderr
