"""The real pair (Qwen2.5-Coder 1.5B with its 0.5B sibling) against llama-server built from source: speed per
workload and stream count, the pass curve and the bounds it sets, bad stored curves, start-up, conversations.

    python benchmarks/pair.py SUBCOMMAND [ARGS]     # python benchmarks/pair.py lists them; SUBCOMMAND -h shows one's options
"""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent / "suite"))
from entry import dispatch  # noqa: E402

COMMANDS = {
    "speed": "pair.py", "curve": "pair_curve.py", "bounds": "bounds.py", "bad-curve": "bad_curve.py",
    "stored-vs-fresh": "stored_vs_fresh.sh", "startup": "startup.py", "conversation": "conversation.py",
}

if __name__ == "__main__":
    sys.exit(dispatch(__doc__, COMMANDS))
