"""A feature draft's directory (drafters/feature.py): its marker file, and which target it serves. Light on
purpose: `specdec generate` and the registry ask whether a path is a draft before anything loads torch.nn."""
from __future__ import annotations

import json
from pathlib import Path

from ..cachedir import per_target
from ..errors import IncompatibleDraft

MARKER = "specdec_draft.json"


def check_target(meta: dict, path, target_fingerprint: str, what: str = "draft", target_sha256: str | None = None
                 ) -> None:
    """A distill directory serves only the target (tokenizer) it was made from; a draft that reads the target's
    inner layers (`target_sha256` in its metadata), only that target file."""
    if meta.get("target_fingerprint") != target_fingerprint:
        raise IncompatibleDraft(f"{what} {path} was trained for another target/tokenizer "
                                f"({meta.get('target_name', '?')})")
    if meta.get("target_sha256") and target_sha256 and meta["target_sha256"] != target_sha256:
        raise IncompatibleDraft(f"{what} {path} reads the inner layers of another target file "
                                f"({meta.get('target_name', '?')}): distill one for this target")


def is_feature_draft(path) -> bool:
    """A draft directory (its marker file), or a draft's own safetensors file, copied alone (draft_meta)."""
    path = Path(path)
    return (path / MARKER).is_file() or (path.suffix == ".safetensors" and path.is_file() and
                                         draft_meta(path) is not None)


def draft_meta(path) -> dict | None:
    """The metadata a draft's safetensors file carries in its header (`save_draft` writes the marker file's JSON
    there too, so the one file is the whole draft), or None. Reads the header only."""
    try:
        with open(path, "rb") as f:
            size = int.from_bytes(f.read(8), "little")
            header = json.loads(f.read(size)) if 0 < size < 1 << 24 else {}
        return json.loads(header.get("__metadata__", {})[MARKER])
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return None


def read_draft(path) -> tuple[dict, dict]:
    """-> a draft's metadata and tensors (its directory, or its safetensors file alone); ValueError or OSError where
    it is not one."""
    from safetensors.torch import load_file
    path = Path(path)
    if path.is_file():  # the draft's safetensors alone, its metadata in the header
        meta = draft_meta(path)
        if meta is None:
            raise ValueError("no specdec draft metadata in its header")
        return meta, load_file(path)
    return json.loads((path / MARKER).read_text()), load_file(path / "model.safetensors")


def installed_draft(target: str) -> Path:
    """Where `specdec distill --target T` without --out keeps T's feature draft: `--draft distilled` runs it."""
    return per_target("drafts", target)
