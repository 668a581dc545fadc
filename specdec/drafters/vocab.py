"""A model draft's trimmed head (`--draft FILE:vocab=N`, the reduced-vocabulary heads of FR-Spec and VocabTrim): the
draft scores only N token ids, so a step reads N rows of its head instead of all of them (the 0.5B's tied head is
151,936 x 896, over a quarter of what a step reads). Its distributions are renormalized over the kept ids (the
others are -inf before the softmax: runtime/slot_cache.fit_vocab), so the draft never proposes a token outside
them, and verification stays exact: the target accepts or corrects any proposal, greedy or sampled.

Which ids: the N most frequent in the target's own text over a prompt set (`specdec vocab --target FILE` counts the
prompts' tokens and the target's answers, stored per target), else the first N ids (BPE ids follow merge order,
roughly frequency). The target's end-of-turn ids are always kept, so the draft can propose the end of an answer."""
from __future__ import annotations

import json
import re
from collections import Counter
from pathlib import Path

import torch

from ..cachedir import per_target, write_atomically

TRIM = re.compile(r"(?P<spec>.+):vocab=(?P<n>[^:+]*)$")
MIN_KEPT = 16  # one q8 row group
COUNTS = "token_counts.json"


def split_trim(spec: str) -> tuple[str, int] | None:
    """`FILE:vocab=N` -> (FILE, N); None for a spec without a trim. A bad N raises ValueError."""
    m = TRIM.fullmatch(spec)
    if m is None:
        return None
    if not m["n"].isdigit() or int(m["n"]) < MIN_KEPT:
        raise ValueError(f"--draft {spec!r}: vocab=N needs a whole number of token ids, at least {MIN_KEPT}")
    return m["spec"], int(m["n"])


def counts_file(target_spec: str) -> Path:
    return per_target("vocab", target_spec) / COUNTS


def load_counts(target_spec: str | None) -> dict[int, int] | None:
    """The token counts `specdec vocab` stored for this target, or None."""
    path = counts_file(target_spec) if target_spec else None
    if path is None or not path.exists():
        return None
    return {int(t): c for t, c in json.loads(path.read_text())["counts"].items()}


def kept_ids(vocab: int, n: int, always: set[int], counts: dict[int, int] | None) -> torch.Tensor:
    """The ids a trimmed head keeps, ascending: `always`, then the most frequent (ties: the lower id; without counts,
    the lowest ids), N in all, rounded up to whole 16-row groups (the q8 layout's)."""
    n = min(vocab, -(-n // MIN_KEPT) * MIN_KEPT)
    order = sorted(range(vocab), key=lambda t: (-counts.get(t, 0), t)) if counts else range(vocab)
    kept = {t for t in always if 0 <= t < vocab}
    for t in order:
        if len(kept) >= n:
            break
        kept.add(t)
    return torch.tensor(sorted(kept), dtype=torch.long)


def count_tokens(token_lists) -> Counter:
    counts: Counter = Counter()
    for ids in token_lists:
        counts.update(ids)
    return counts


def store_counts(target_spec: str, counts: Counter, meta: dict) -> Path:
    path = counts_file(target_spec)
    write_atomically(path, json.dumps({**meta, "counts": {str(t): c for t, c in counts.most_common()}}).encode())
    return path
