"""The benchmarks' entry points (benchmarks/pair.py, serve.py, runtime.py, draft.py, docs.py): each names its
subcommands, one module of benchmarks/suite/ apiece, and runs the one asked for as if it were a script, with the
rest of the command line as its arguments. With no subcommand (or -h), it lists them with their first lines."""
from __future__ import annotations

import ast
import os
import subprocess
import sys
import types
from pathlib import Path

SUITE = Path(__file__).resolve().parent


def summary(module: str) -> str:
    """The first sentence of a module's docstring (or a shell script's first comment), read without importing it."""
    path = SUITE / module
    if path.suffix == ".sh":
        lines = [ln[2:] for ln in path.read_text().splitlines()[1:4] if ln.startswith("# ")]
        doc = " ".join(lines)
    else:
        doc = ast.get_docstring(ast.parse(path.read_text())) or ""
    first = " ".join(doc.split("\n\n")[0].split()).split(". ")[0].rstrip(".:")
    return first if len(first) <= 100 else first[:first.rfind(" ", 0, 99)] + " …"


def dispatch(doc: str, commands: dict[str, str], argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else list(argv)
    entry = Path(sys.argv[0]).name
    if not args or args[0] in ("-h", "--help", "help"):
        print(doc.strip() + "\n\nsubcommands (each takes -h):")
        width = max(map(len, commands))
        for name, module in commands.items():
            print(f"  {name:<{width}}  {summary(module)}")
        return 0
    name, rest = args[0], args[1:]
    if name not in commands:
        print(f"{entry}: unknown subcommand {name!r} (choose from {', '.join(commands)})", file=sys.stderr)
        return 2
    path = SUITE / commands[name]
    if path.suffix == ".sh":
        return subprocess.call(["bash", str(path), *rest])
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    sys.path.insert(0, str(SUITE))
    sys.argv = [f"{entry} {name}", *rest]  # so that argparse names the command as typed
    module = types.ModuleType("__main__")
    module.__file__ = str(path)
    saved, sys.modules["__main__"] = sys.modules["__main__"], module
    try:
        exec(compile(path.read_text(), str(path), "exec"), module.__dict__)
    except SystemExit as done:
        return done.code if isinstance(done.code, int) else (0 if done.code is None else 1)
    finally:
        sys.modules["__main__"] = saved
    return 0
