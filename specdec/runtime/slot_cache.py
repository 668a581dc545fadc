"""One sequence in one KV slot of the runtime's model (kv.CachedModel's interface: what the engine and drafters
call), and the helpers a slot's owner needs: the common prefix of two token lists, logits fitted to a vocabulary."""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from .model import Llama


def common_prefix_len(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    if a[:n] == b[:n]:
        return n
    return next(i for i in range(n) if a[i] != b[i])


class SlotCache:
    """One sequence in one KV slot, with kv.CachedModel's interface (what the engine and drafters use):
    `forward(tokens, n_logits)` runs only the tokens the slot lacks, rolling back past any divergence first."""

    def __init__(self, model: Llama, vocab_size: int):
        self.model, self.vocab_size = model, vocab_size
        self.slot = model.acquire_slot()
        self.tokens: list[int] = []
        self.last_start = 0

    def reset(self) -> None:
        self.tokens = []

    def rollback(self, length: int) -> None:
        del self.tokens[length:]  # the slot's length; the positions beyond are overwritten by the next pass
        self.model.truncate(self.slot, length)  # and their blocks go back to the pool

    def unseen(self, tokens: list[int], n_logits: int = 1) -> list[int]:
        """Roll back past any divergence from `tokens` (keeping at least n_logits of them to run) -> the tokens the
        slot lacks, which the next pass runs from position `last_start`."""
        self.rollback(min(common_prefix_len(self.tokens, tokens), len(tokens) - n_logits))
        self.last_start = len(self.tokens)
        return tokens[self.last_start:]

    def forward(self, tokens: list[int], n_logits: int = 1, hidden: bool = False, head_rows: int | None = None):
        new = self.unseen(tokens, n_logits)
        start = self.last_start
        out = self.model.forward(new, [self.slot] * len(new), list(range(start, len(tokens))),
                                 range(len(new) - n_logits, len(new)), hidden, head_rows=head_rows)
        self.tokens.extend(new)
        logits = out[0] if hidden else out
        logits = fit_vocab(logits, self.vocab_size, self.model.head_ids)
        return (logits, out[1]) if hidden else logits

    def forward_tree(self, tokens: list[int], tree: list[int], parents: list[int], hidden: bool = False):
        """One pass over the tokens the slot lacks and a token tree after them -> logits [1 + len(tree), V]: the
        row of tokens[-1] (which the tree hangs from, parent -1), then one per node (parents[i] < i is node i's
        parent). Nodes are stored after the sequence in their order, and each attends to its own path only.
        Only `tokens` count as cached afterwards; keep_path() then moves an accepted path into place. hidden=True
        also returns every row's final hidden state (the rows the slot lacked, then the nodes)."""
        self.rollback(min(common_prefix_len(self.tokens, tokens), len(tokens) - 1))
        start = self.last_start = len(self.tokens)
        new, base = tokens[start:], len(tokens)
        paths, depth = [None] * len(new), []
        for i, parent in enumerate(parents):
            depth.append(1 if parent < 0 else depth[parent] + 1)
            paths.append((paths[len(new) + parent] if parent >= 0 else []) + [base + i])
        out = self.model.forward(new + list(tree), [self.slot] * (len(new) + len(tree)),
                                 list(range(start, base)) + [base - 1 + d for d in depth],
                                 range(len(new) - 1, len(new) + len(tree)), hidden, paths=paths)
        self.tokens.extend(new)
        self._tree = (base, tree, paths[len(new):])
        ids = self.model.head_ids
        return (fit_vocab(out[0], self.vocab_size, ids), out[1]) if hidden else fit_vocab(out, self.vocab_size, ids)

    def keep_path(self, nodes: list[int]) -> None:
        """After forward_tree: the accepted nodes (a root-to-node path, in order) join the cached sequence, their
        keys and values moved to the positions they hold in it."""
        base, tree, paths = self._tree
        if nodes:
            self.model.move_positions(self.slot, list(zip(paths[nodes[-1]], range(base, base + len(nodes)))))
        del self.tokens[base:]
        self.tokens.extend(tree[i] for i in nodes)
        self.model.truncate(self.slot, len(self.tokens))  # the other nodes' blocks back to the pool

    def close(self) -> None:
        if self.slot is not None:
            self.model.release_slot(self.slot)
            self.slot = None

    def __del__(self):
        self.close()


def forward_slots(caches: list[SlotCache], seqs: list[list[int]], head_rows: int | None = None) -> torch.Tensor:
    """Several slots of one model in one pass: each runs the tokens of its sequence it lacks -> the logits of each
    sequence's last token [len(caches), V]. Every row is computed as alone (the runtime is row-invariant), so each
    row of logits is bitwise what that slot's own forward() gives."""
    tokens, slots, positions, last = [], [], [], []
    for cache, seq in zip(caches, seqs):
        new = cache.unseen(seq)
        tokens += new
        slots += [cache.slot] * len(new)
        positions += range(cache.last_start, len(seq))
        last.append(len(tokens) - 1)
    logits = caches[0].model.forward(tokens, slots, positions, last, head_rows=head_rows)
    for cache, seq in zip(caches, seqs):
        cache.tokens.extend(seq[cache.last_start:])
    return fit_vocab(logits, caches[0].vocab_size, caches[0].model.head_ids)


def fit_vocab(logits: torch.Tensor, vocab: int, head_ids: torch.Tensor | None = None) -> torch.Tensor:
    """Models may pad their output head; align every model to the target's vocabulary size. A trimmed head's logits
    (over `head_ids`) go to their token ids, the rest -inf: a softmax over them is renormalized over the kept set."""
    if head_ids is not None:
        full = logits.new_full((*logits.shape[:-1], vocab), float("-inf"))
        full[..., head_ids] = logits
        return full
    if logits.shape[-1] > vocab:
        return logits[..., :vocab]
    if logits.shape[-1] < vocab:
        pad = logits.new_full((*logits.shape[:-1], vocab - logits.shape[-1]), float("-inf"))
        return torch.cat([logits, pad], -1)
    return logits
