"""Measurements of a model on this machine (pass curves, row costs), taken once and remembered.

A server sizes its row budget and admission on how long passes take; measuring that costs seconds on a 1.5B model at
every start. The numbers depend on the model file, the machine, the kernel build and the numerics, so they are stored
under $SPECDEC_CACHE/measured/ keyed by exactly those, and a server refines its copy online (batch.BatchEngine's
moving averages) and stores what it refined when it stops (`store_curve`): a curve measured at a slow moment of a
shared machine is not kept for good. SPECDEC_REMEASURE=1 measures again and replaces what is stored.
"""
from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Callable
from pathlib import Path

import torch

from .. import kernels
from ..cachedir import cache_root, write_atomically


def machine() -> str:
    """What a timing depends on besides the model: the CPU, how many cores and threads, the kernel build, its
    prefetch distances and its tiles (AMX, wide)."""
    cpu = kernels.cpuinfo("model name") or "unknown"
    lib = kernels.library()
    build = f"{lib.key}|ahead {lib.prefetch}|amx {lib.amx_rows}|wide {lib.wide}" if lib else "torch"
    return f"{cpu}|{os.cpu_count()}|{torch.get_num_threads()}|{build}"


def remembered(model, what: str, params: dict, measure: Callable[[], object]):
    """measure() (JSON-serialisable) once per (model file, machine, numerics, what, params); the stored value
    afterwards. Models that are not one file (in-memory, directories) are measured every time."""
    if not getattr(model, "fingerprint", None):
        return measure()
    if os.environ.get("SPECDEC_REMEASURE") != "1":
        found = stored(model, what, params)
        if found is not None:
            return found
    value = measure()
    _store(model, what, params, value)
    return value


def stored(model, what: str, params: dict):
    """What remembered() would read back for (model, what, params), or None (nothing stored, or not one file)."""
    if not getattr(model, "fingerprint", None):
        return None
    key, path = _where(model, what, params)
    try:
        found = json.loads(path.read_text())
        return found["value"] if found["key"] == key else None
    except (OSError, ValueError, KeyError, TypeError):
        return None


def _where(model, what: str, params: dict) -> tuple[str, Path]:
    key = json.dumps([model.fingerprint, machine(), model.numerics, what, params], sort_keys=True)
    return key, cache_root() / "measured" / f"{what}-{hashlib.sha256(key.encode()).hexdigest()[:24]}.json"


def _store(model, what: str, params: dict, value) -> None:
    key, path = _where(model, what, params)
    try:
        write_atomically(path, json.dumps({"key": key, "value": value}).encode())
    except OSError:
        pass  # an unwritable cache: measured again next time


def remembered_curve(model, what: str, params: dict, measure: Callable[[], dict[int, float]]) -> dict[int, float]:
    """remembered() for {rows: ms} curves (JSON keeps their keys as strings)."""
    got = remembered(model, what, params, lambda: [[n, ms] for n, ms in measure().items()])
    return {int(n): float(ms) for n, ms in got}


def store_curve(model, what: str, params: dict, curve: dict[int, float]) -> None:
    """Replace the stored {rows: ms} curve of (model, what, params) with `curve` (a server's refinement of it)."""
    if getattr(model, "fingerprint", None) and curve:
        _store(model, what, params, [[n, ms] for n, ms in sorted(curve.items())])


def forget(model, what: str, params: dict) -> None:
    """Drop what is stored for (model, what, params): the next start measures it."""
    if getattr(model, "fingerprint", None):
        _where(model, what, params)[1].unlink(missing_ok=True)
