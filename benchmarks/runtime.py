"""The q8 runtime and its kernels: numerics against transformers and llama.cpp, losslessness, pass
curves (one process, two checkouts, AMX against VNNI), prefetch settings, kernel peaks, GGUF targets.

    python benchmarks/runtime.py SUBCOMMAND [ARGS]     # python benchmarks/runtime.py lists them; SUBCOMMAND -h shows one's options
"""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent / "suite"))
from entry import dispatch  # noqa: E402

COMMANDS = {
    "numerics": "numerics.py", "lossless": "lossless.py", "same-kernels": "same_kernels.py",
    "verify-curve": "verify_curve.py", "ab-curve": "ab_curve.py", "tile-curve": "tile_curve.py", "tree-cost": "tree_cost.py",
    "prefetch-ab": "prefetch_ab.py", "vnni-peak": "vnni_peak.py", "gguf-target": "gguf_target.py",
    "synthetic-gguf": "synthetic_gguf.py",
}

if __name__ == "__main__":
    sys.exit(dispatch(__doc__, COMMANDS))
