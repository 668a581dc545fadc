"""Drafts and how far they draft: τ per workload, trees, trees built early, and in-process ablations of a
module constant or a draft.

    python benchmarks/draft.py SUBCOMMAND [ARGS]     # python benchmarks/draft.py lists them; SUBCOMMAND -h shows one's options
"""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent / "suite"))
from entry import dispatch  # noqa: E402

COMMANDS = {
    "length": "draft_length.py", "trees": "trees.py", "early-trees": "early_trees.py", "ablate": "ablate.py",
}

if __name__ == "__main__":
    sys.exit(dispatch(__doc__, COMMANDS))
