"""How far ahead one-row q8 tiles prefetch their weights, chosen by measurement on this machine.

A one-row pass (a decode step of one request) reads every weight once; whether a software prefetch ahead of the
block stream helps depends on the core, not only on its vendor. On one 2-core EPYC prefetching nothing was 0.86-0.90x
the time of prefetching 8 KB ahead; on another the same choice made the 1.5B's one-row pass 31.8 ms against 13.9 ms
(docs/runtime.md, "Prefetch"). So the first q8 model loaded with a file behind it times one-row passes at each
CANDIDATE distance, interleaved, and keeps the fastest; the choice is stored like the pass curve (runtime/measured.py,
per model file, machine and kernel build) and set once per process. Prefetching changes no bit of any result.
SPECDEC_Q8_AHEAD, where set, is used as it is.
"""
from __future__ import annotations

import os
from statistics import median
from time import perf_counter

import torch

from .. import kernels
from .measured import remembered
from .progress import Step

CANDIDATES = (0, 2048, 4096, 8192, 16384)
REPS = 7
CONTEXT = 64
_chosen: list[int] = []  # the distance set in this process (the first model's choice holds for every model)


def choose(model) -> int | None:
    """Set the one-row distance for this process from `model`'s measurement (stored after the first); None where
    nothing is chosen (no kernels, not q8, not one file, SPECDEC_Q8_AHEAD set, or already chosen)."""
    lib = kernels.library()
    if (_chosen or lib is None or not getattr(model, "q8", False) or not getattr(model, "fingerprint", None)
            or os.environ.get("SPECDEC_Q8_AHEAD", "").strip()):
        return None
    lib.set_prefetch(*kernels.prefetch_distances())  # the key's distances (measured.machine): the vendor's default
    best = int(remembered(model, "prefetch_one_row", {"candidates": list(CANDIDATES), "reps": REPS},
                          lambda: _fastest(model, lib)))
    lib.set_prefetch(best, -1, -1)
    _chosen.append(best)
    return best


def one_row_ms(model, lib, candidates=CANDIDATES, reps: int = REPS, step: Step | None = None) -> dict[int, float]:
    """Median ms of a one-row pass at each distance, the distances interleaved (drift hits each alike)."""
    slot = model.acquire_slot()
    before = lib.prefetch
    times = {d: [] for d in candidates}
    try:
        with torch.inference_mode():
            model.forward(list(range(1, CONTEXT + 1)), [slot] * CONTEXT, list(range(CONTEXT)), [])
            t0 = perf_counter()
            for r in range(reps + 1):  # the first round warms up
                if r == 1 and step is not None:
                    step.expect((perf_counter() - t0) * reps)
                for d in candidates:
                    lib.set_prefetch(d, -1, -1)
                    t = perf_counter()
                    model.forward([1], [slot], [CONTEXT])
                    times[d].append((perf_counter() - t) * 1e3)
    finally:
        lib.set_prefetch(*before)
        model.release_slot(slot)
    return {d: median(t[1:]) for d, t in times.items()}


def _fastest(model, lib) -> int:
    with Step("choosing how far one-row q8 passes prefetch (once on this machine)") as step:
        ms = one_row_ms(model, lib, step=step)
        best = min(ms, key=ms.get)
        step.say(", ".join(f"{d // 1024} KB {t:.1f} ms" for d, t in ms.items()) + f": {best // 1024} KB")
    return best
