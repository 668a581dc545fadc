"""The q8 layout of a GGUF file's weights, made once and memory-mapped at every later start.

Repacking a 1.5B Q4_K_M file for the q8 kernels reads and rewrites 1.1 GB (tens of seconds on 2 cores). The layout
depends only on the file's bytes and the kernel build, so it is written once to

    $SPECDEC_CACHE/q8/<sha256 of the GGUF, 24 hex>-<kernel build key>.q8    (the layouts, 64-byte aligned)
    ... .json                                                              (each tensor's format, shape, offset)

and mapped read-only afterwards: nothing is copied, the pages are shared by every process and replica on the
machine, and the file's own quantized blocks are never read for the linears. The file is built beside its final name
and renamed into place, so a reader never sees a part; an index that does not describe this model's tensors, or a
file of the wrong size, is rebuilt. Each tensor's span has a CRC-32 in the index, checked at every mapping (both
cores, ~0.3 s a gigabyte; the pages are read once, as the first pass would read them): a damaged file (flipped
pages, a disk error) is rebuilt with one stderr line, never used. An unwritable cache falls back to repacking in
memory, with one stderr line.
"""
from __future__ import annotations

import json
import os
import sys
import tempfile
import zlib
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import torch

from .. import kernels
from ..cachedir import cache_root, write_atomically
from .progress import Progress
from .weights import QTensor, release_pages

ALIGN = 64
VERSION = 2  # 2: a CRC-32 per span


def q8_weights(model) -> list[QTensor]:
    """The model's linears in a fixed order (layers' q, k, v, o, gate, up, down; then the head), each once."""
    seen, out = set(), []
    for w in model.layers:
        for t in (w.q, w.k, w.v, w.o, w.gate, w.up, w.down):
            if id(t) not in seen:
                seen.add(id(t))
                out.append(t)
    if id(model.head) not in seen:
        out.append(model.head)
    return out


def cache_path(model) -> Path | None:
    """Where this model's q8 layout lives, or None (not a GGUF file, or no kernels)."""
    lib = kernels.library()
    src = Path(model.source) if model.source else None
    if lib is None or src is None or src.suffix != ".gguf" or not src.is_file():
        return None
    return cache_root() / "q8" / f"{model.fingerprint[:24]}-{lib.key}.q8"


def attach(model) -> str:
    """Give every q8 weight of `model` its layout from the cache file, building the file first if needed.
    Returns what happened: 'mapped', 'built', or 'memory' (no cache file: layouts made in memory as needed)."""
    path = cache_path(model)
    if path is None or os.environ.get("SPECDEC_Q8_CACHE", "1") == "0":
        return "memory"
    weights = q8_weights(model)
    if _map(path, weights):
        return "mapped"
    try:
        _build(path, weights, Path(model.source))
    except OSError as e:
        print(f"specdec: cannot write the q8 cache {path} ({e.strerror or e}); repacking in memory at every start",
              file=sys.stderr)
        return "memory"
    if not _map(path, weights):
        raise RuntimeError(f"the q8 cache {path} just written does not read back")
    return "built"


def _describe(weights: list[QTensor]) -> list[dict]:
    return [{"fmt": w.fmt, "n": w.n, "k": w.k} for w in weights]


def _map(path: Path, weights: list[QTensor]) -> bool:
    """Map a finished cache file onto the weights; False if there is none or it does not describe them."""
    try:
        index = json.loads(path.with_suffix(".json").read_text())
        if index.get("version") != VERSION or index["tensors"] != _describe(weights):
            return False
        if path.stat().st_size != index["bytes"]:
            return False
        data = np.memmap(path, dtype=np.uint8, mode="r") if index["bytes"] else np.zeros(0, np.uint8)
        bad = _damaged(data, index["spans"], index["crc"])
    except (OSError, ValueError, KeyError, TypeError):
        return False
    if bad is not None:
        print(f"specdec: the q8 cache {path.name} is damaged (tensor {bad}'s layout fails its checksum); rebuilding it",
              file=sys.stderr)
        return False
    import warnings
    with warnings.catch_warnings():  # a read-only map: the kernels never write to their weights
        warnings.simplefilter("ignore", UserWarning)
        whole = torch.from_numpy(data)
    for w, (at, size) in zip(weights, index["spans"]):
        w.use_packed(None if size is None else whole[at: at + size])
        if size is not None and w.mapped:
            release_pages(w.data)  # pages the loader's reads of nearby metadata and norms faulted in: q8 reads the map
    return True


def _crcs(data, spans: list) -> list[int | None]:
    """Each span's CRC-32, on both cores (zlib lets the GIL go for long buffers)."""
    def crc(span):
        at, size = span
        return None if size is None else zlib.crc32(memoryview(data[at: at + size]))
    with ThreadPoolExecutor(2) as pool:
        return list(pool.map(crc, spans))


def _damaged(data, spans: list, crcs: list) -> int | None:
    """The first tensor whose span fails its checksum, or None."""
    if len(crcs) != len(spans):
        raise ValueError("an index without a checksum per span")
    return next((i for i, (got, want) in enumerate(zip(_crcs(data, spans), crcs)) if got != want), None)


def _build(path: Path, weights: list[QTensor], source: Path) -> None:
    sizes = [w.repacked_bytes() for w in weights]
    spans, at = [], 0
    for size in sizes:
        spans.append([at, size])
        at += -(-(size or 0) // ALIGN) * ALIGN
    total = at
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.stem + ".", suffix=".part")
    os.close(fd)
    try:
        os.truncate(tmp, total)
        mm = np.memmap(tmp, dtype=np.uint8, mode="r+") if total else None
        out = torch.from_numpy(mm) if total else None
        with Progress(f"the q8 layout of {source.name}", "repacking", total, path.parent) as progress:
            for w, span in zip(weights, spans):
                if span[1] is None:
                    continue
                if w.pack_into(out[span[0]: span[0] + span[1]]) is None:
                    span[1] = None  # scales beyond fp16: this tensor runs exact
                progress.advance(span[1] or 0)
        crcs = _crcs(mm, spans) if mm is not None else [None] * len(spans)
        if mm is not None:
            mm.flush()
            del out, mm
        os.chmod(tmp, 0o644)
        os.replace(tmp, path)
    finally:
        Path(tmp).unlink(missing_ok=True)
    _drop_older_builds(path)
    write_atomically(path.with_suffix(".json"), json.dumps(
        {"version": VERSION, "source": str(source), "bytes": total, "tensors": _describe(weights),
         "spans": spans, "crc": crcs}).encode())


def _drop_older_builds(path: Path) -> None:
    """Remove this file's layouts from other kernel builds of the same instruction set (an upgrade's leftovers: a
    gigabyte each for a 1.5B model). A process still mapping one keeps reading it until it exits (POSIX unlink)."""
    fingerprint, _, isa, _ = path.stem.split("-", 3)
    for old in path.parent.glob(f"{fingerprint}-rows-{isa}-*"):
        if old.stem != path.stem and old.suffix in (".q8", ".json"):
            old.unlink(missing_ok=True)
