"""The docs' tables from the benchmarks' JSON results.

    python benchmarks/docs.py SUBCOMMAND [ARGS]     # python benchmarks/docs.py lists them; SUBCOMMAND -h shows one's options
"""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent / "suite"))
from entry import dispatch  # noqa: E402

COMMANDS = {
    "tables": "tables.py",
}

if __name__ == "__main__":
    sys.exit(dispatch(__doc__, COMMANDS))
