"""Where specdec keeps what it computes once (kernels, tokenizers, q8 layouts, measured pass costs, drafts):
$SPECDEC_CACHE, default ~/.cache/specdec. A leaf module: it imports nothing of specdec's."""
from __future__ import annotations

import hashlib
import json
import os
import tempfile
from pathlib import Path

from .runtime.progress import Step


def cache_root() -> Path:
    return Path(os.environ.get("SPECDEC_CACHE", Path.home() / ".cache" / "specdec"))


def per_target(kind: str, target: str) -> Path:
    """The cache directory of `kind` (datastores, drafts, vocab) for `target`: a file by its content (file_sha256:
    a copy of the file finds the same directory, a changed file another), a directory by its resolved path, or a
    model name."""
    path = Path(target).expanduser()
    key = file_sha256(path) if path.is_file() else str(path.resolve()) if path.exists() else str(target)
    return cache_root() / kind / f"{path.stem or 'model'}-{hashlib.sha256(key.encode()).hexdigest()[:12]}"


def write_atomically(path: Path, data: bytes) -> None:
    """Write a small file so that a reader sees the old bytes or the new, never a part (rename into place)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name + ".")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.chmod(tmp, 0o644)
        os.replace(tmp, path)
    finally:
        Path(tmp).unlink(missing_ok=True)


HASH_BYTES_PER_S = 1e9  # sha256 on one core, about (what a hashing step's expected time is said from; under 1 s: silent)


def file_sha256(path: str | os.PathLike) -> str:
    """The sha256 of a file's content, read once: remembered under the cache by the file's identity (device,
    inode, size, modification time), so a later start pays a stat, and a copy of the file (another identity)
    hashes to the same key."""
    def digest(p: Path) -> str:
        h, size = hashlib.sha256(), p.stat().st_size
        with Step(f"hashing {p.name} (once per file)", size / HASH_BYTES_PER_S, quiet=size < HASH_BYTES_PER_S):
            with open(p, "rb") as f:
                while chunk := f.read(1 << 24):
                    h.update(chunk)
        return h.hexdigest()
    return remembered_of_file(path, "file-hashes", "sha256", digest, str)


def remembered_of_file(path: str | os.PathLike, kind: str, name: str, compute, valid: type = object):
    """compute(path), remembered under $SPECDEC_CACHE/<kind>/ by the file's identity (device, inode, size,
    modification time): a later call pays a stat while the file stays the same. `valid`: a stored value's type."""
    path = Path(path).resolve()
    st = path.stat()
    ident = [st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns]
    memo = cache_root() / kind / (hashlib.sha256(str(path).encode()).hexdigest()[:24] + ".json")
    try:
        known = json.loads(memo.read_text())
        if known.get("identity") == ident and isinstance(known.get(name), valid):
            return known[name]
    except (OSError, ValueError, AttributeError):
        pass
    value = compute(path)
    try:
        write_atomically(memo, json.dumps({"identity": ident, name: value}).encode())
    except OSError:
        pass  # an unwritable cache: computed again next time
    return value
