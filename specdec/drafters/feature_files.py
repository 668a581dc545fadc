"""A feature draft's directory (drafters/feature.py): its marker file, and which target it serves. Light on
purpose: `specdec generate` and the registry ask whether a path is a draft before anything loads torch.nn."""
from __future__ import annotations

from pathlib import Path

from ..cachedir import per_target
from ..errors import IncompatibleDraft

MARKER = "specdec_draft.json"


def check_target(meta: dict, path, target_fingerprint: str, what: str = "draft") -> None:
    """A distill directory serves only the target (tokenizer) it was made from."""
    if meta.get("target_fingerprint") != target_fingerprint:
        raise IncompatibleDraft(f"{what} {path} was trained for another target/tokenizer "
                                f"({meta.get('target_name', '?')})")


def is_feature_draft(path) -> bool:
    return (Path(path) / MARKER).is_file()


def installed_draft(target: str) -> Path:
    """Where `specdec distill --target T` without --out keeps T's feature draft: `--draft distilled` runs it."""
    return per_target("drafts", target)
