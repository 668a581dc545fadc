"""Retrieval drafting (REST, He et al. 2024): look the context's last n tokens (n = 4, then 3) up in a datastore of
the target's own earlier outputs and propose the continuation most of the matches share. Model-free (q is one-hot),
so a cycle costs only the lookup: a few numpy calls (torch's per-call overhead is ~10x numpy's on arrays this
small), or a dict hit when the same last 4 tokens were looked up before (the walk depends on nothing else).

The walk stops at the first token that fewer than `min_count` matches (default 2), or less than `min_share` (default
0.5) of the matches still agreeing, support — the datastore's own confidence. Measured with the shipped draft's
datastore (the 561k tokens it was trained on): docs/benchmarks.md, docs/draft.md."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch

from ..cachedir import per_target
from ..errors import ModelLoadError
from .base import Draft

FILE = "datastore.safetensors"
META = "datastore.json"  # what it was built for (the target, its tokenizer fingerprint)
ORDERS = (4, 3)
MAX_MATCHES = 256  # the most recent matches are enough to find the majority
# n-gram keys: h = h·MIX + token, wrapping in int64. Any vocabulary fits (a positional base of vocab^n overflowed
# past vocab ~55k and merged unrelated n-grams); a rare collision only widens a search range, since every
# candidate is checked against the context's tokens.
MIX = 0x100000001B3  # the 64-bit FNV prime: odd, so each step is a bijection of the int64 ring
MEMO_DEPTH, MEMO_ENTRIES = 16, 1 << 16  # walks kept by their last 4 tokens (cleared when full)


def _key(gram) -> int:
    """The int64 hash of one n-gram, as _table computes it (h = h·MIX + token, wrapping)."""
    h = 0
    for t in gram:
        h = (h * MIX + int(t)) & 0xFFFFFFFFFFFFFFFF
    return h - (1 << 64) if h >= 1 << 63 else h


class DatastoreDrafter:
    free = True  # model-free: a lookup costs next to nothing
    def __init__(self, tokens: torch.Tensor, vocab_size: int, name: str = "datastore", min_count: int = 2,
                 min_share: float = 0.5):
        """tokens: 1-D int tensor of sequences separated by -1."""
        self.tokens, self.vocab, self.name = tokens.int(), vocab_size, name
        self.min_count, self.min_share = min_count, min_share
        self.tables = {n: tuple(t.numpy() for t in self._table(n)) for n in ORDERS}
        self._tokens = self.tokens.numpy()
        self._memo: dict[tuple, tuple[list[int], list[float], int]] = {}  # (thresholds, last 4 tokens) -> walk, shares, depth

    def _table(self, n: int):
        """Sorted hashes of every n-gram that lies inside one sequence and has a follower, with its end offset.
        Built from shifted views (no [N, n] window copy): loading stays within a few MB of temporaries."""
        L = len(self.tokens) - n  # n-grams tokens[i:i+n] with a follower tokens[i+n], i < L
        if L <= 0:
            return torch.zeros(0, dtype=torch.long), torch.zeros(0, dtype=torch.long)
        ok = self.tokens[n:] >= 0
        hashes = torch.zeros(L, dtype=torch.long)
        for j in range(n):
            column = self.tokens[j: j + L]
            ok &= column >= 0
            hashes.mul_(MIX).add_(column.long())
        ends = torch.nonzero(ok).squeeze(1).add_(n).int()
        hashes = hashes[ok]
        order = torch.argsort(hashes, stable=True)  # stable: equal keys stay in datastore order (recent last)
        return hashes[order], ends[order]

    def propose(self, context, k, params, generator) -> Draft:
        key = (self.min_count, self.min_share, *context[-ORDERS[0]:])
        hit = self._memo.get(key)
        if hit is None or (hit[2] < k and len(hit[0]) == hit[2]):  # (a walk that stopped early is complete)
            found = self._matches(context)
            depth = max(k, MEMO_DEPTH)
            hit = ([], [], depth) if found is None else (*self._walk(found, depth, with_shares=True), depth)
            if len(self._memo) >= MEMO_ENTRIES:
                self._memo.clear()
            self._memo[key] = hit
        return Draft(hit[0][:k])

    def propose_tree(self, context, k, params, generator, branches: int = 2) -> Draft:
        """The majority continuation and up to `branches - 1` runner-ups at the first token, each walked on as
        `_walk` does, as one tree; a node's value is the share of matches that agree with its path (the
        datastore's own estimate that the target continues that way)."""
        found = self._matches(context)
        if found is None:
            return Draft()
        nxt = self._next(found)
        values, counts = np.unique(nxt[nxt >= 0], return_counts=True)
        tokens, parents, vals = [], [], []
        for j in np.argsort(-counts, kind="stable")[:branches].tolist():
            count, token = int(counts[j]), int(values[j])
            if count < self.min_count or (tokens and count < self.min_share * len(found) / 2):
                break
            share = count / len(found)
            tokens.append(token), parents.append(-1), vals.append(share)
            starts = found[nxt == token] + 1
            rest, shares = self._walk(starts, k - 1, with_shares=True)
            for t, sh in zip(rest, shares):
                tokens.append(t), parents.append(len(tokens) - 2), vals.append(vals[-1] * sh)
        order = sorted(range(len(tokens)), key=lambda i: -vals[i])  # best first (parents before children)
        where = {old: new for new, old in enumerate(order)}
        return Draft([tokens[i] for i in order], parents=[-1 if parents[i] < 0 else where[parents[i]] for i in order],
                     values=[vals[i] for i in order])

    def _matches(self, context):
        """End offsets of the datastore's occurrences of the context's last n tokens (n = 4, then 3), the most recent
        MAX_MATCHES; None when fewer than min_count."""
        for n in ORDERS:
            if len(context) < n:
                continue
            hashes, ends = self.tables[n]
            gram = np.asarray(context[-n:], dtype=np.int32)
            key = _key(gram)
            lo, hi = np.searchsorted(hashes, key), np.searchsorted(hashes, key, side="right")
            found = ends[lo:hi].astype(np.int64)
            found = found[(self._tokens[found[:, None] - n + np.arange(n)] == gram).all(1)]  # collisions out
            if len(found) >= self.min_count:
                return found[-MAX_MATCHES:]
        return None

    def _next(self, pos: np.ndarray) -> np.ndarray:
        """The token at each offset, -1 past the end (and at sequence separators)."""
        return np.where(pos < len(self._tokens), self._tokens[np.minimum(pos, len(self._tokens) - 1)], -1)

    def _walk(self, starts: np.ndarray, k: int, with_shares: bool = False):
        out, shares = [], []
        for i in range(k):
            nxt = self._next(starts + i)
            valid = nxt[nxt >= 0]
            if len(valid) == 0:
                break
            values, counts = np.unique(valid, return_counts=True)
            best = int(counts.argmax())
            count = int(counts[best])
            if count < self.min_count or count < self.min_share * len(starts):
                break
            token = int(values[best])
            out.append(token), shares.append(count / len(starts))
            starts = starts[nxt == token]
        return (out, shares) if with_shares else out

    def reset(self) -> None:
        pass

    # ---- persistence ---------------------------------------------------------------------------------------
    @staticmethod
    def save(sequences: list[list[int]], out: Path) -> None:
        from safetensors.torch import save_file
        flat = [t for s in sequences for t in (*s, -1)]
        save_file({"tokens": torch.tensor(flat, dtype=torch.int32)}, Path(out) / FILE)

    @classmethod
    def load(cls, path, vocab_size: int, name: str | None = None) -> DatastoreDrafter:
        path = Path(path)
        file = path / FILE if path.is_dir() else path
        try:
            from safetensors.torch import load_file
            tokens = load_file(file)["tokens"]
        except (OSError, ValueError, KeyError) as e:
            raise ModelLoadError(f"cannot load datastore {file}: {e}")
        if tokens.dim() != 1 or (len(tokens) and int(tokens.max()) >= vocab_size):
            raise ModelLoadError(f"datastore {file} does not fit this target's vocabulary")
        return cls(tokens, vocab_size, name or f"datastore:{path}")


def datastore_dir(target: str) -> Path:
    """Where `datastore build` keeps the datastore of `target` (a file or directory path, or a model name)."""
    return per_target("datastores", target)


def check_datastore(path: Path, fingerprint: str) -> None:
    """A built datastore belongs to one tokenizer: refuse it for a target that tokenizes differently."""
    meta_file = Path(path) / META
    if not meta_file.exists():
        return
    try:
        meta = json.loads(meta_file.read_text())
        built_for = meta.get("fingerprint"), meta.get("target")
    except (OSError, ValueError, AttributeError):
        raise ModelLoadError(f"the datastore in {path} has an unreadable {META}; rebuild it with "
                             "`specdec datastore build --target ...`") from None
    if built_for[0] != fingerprint:
        raise ModelLoadError(f"the datastore in {path} was built for another tokenizer ({built_for[1]}); rebuild it "
                             "with `specdec datastore build --target ...`")
