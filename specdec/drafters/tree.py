"""Token trees: the shapes drafters propose and the target verifies in one pass (runtime.model: a node attends to
its path only). A tree is (tokens, parents) with parents[i] < i; -1 is the context's last token, the root.

How many nodes to verify is the cost model's call (costs.best_tree_size): nodes come best-first by their value v,
the estimated probability that the node is accepted (its whole path accepted), and n nodes are worth
(1 + Σ_{i≤n} v_i) tokens for a pass over n + 1 rows. Best-first keeps the tree closed under ancestors: a node's value
never exceeds its parent's.
"""
from __future__ import annotations

import heapq

from .base import Draft


def depths(parents: list[int]) -> list[int]:
    """Depth of each node: 1 for a child of the root."""
    out: list[int] = []
    for p in parents:
        out.append(1 if p < 0 else out[p] + 1)
    return out


def path(parents: list[int], node: int) -> list[int]:
    """The nodes from the root's child down to `node`."""
    out = []
    while node >= 0:
        out.append(node)
        node = parents[node]
    return out[::-1]


def best_chain(draft: Draft) -> list[int]:
    """A draft's tokens as a chain: a chain as it is, a tree's deepest branch (the first of the deepest)."""
    if not draft.is_tree:
        return list(draft.tokens)
    ds = depths(draft.parents)
    if not ds:
        return []
    leaf = max(range(len(ds)), key=lambda i: (ds[i], -i))
    return [draft.tokens[i] for i in path(draft.parents, leaf)]


def chain_parents(n: int) -> list[int]:
    return list(range(-1, n - 1))


def best_first(root: int, children_of, max_nodes: int, max_depth: int) -> Draft:
    """Grow a tree best-first from the context's last token `root`: children_of(token, depth) gives [(token, p)],
    p the probability that a child at that depth is accepted once its parent is; a node's value is the product
    along its path. Siblings with the same token are merged (the first kept). -> a Draft whose nodes come in
    decreasing value, at most max_depth deep."""
    tokens, parents, values = [], [], []
    heap = [(-p, i, -1, t, 1) for i, (t, p) in enumerate(children_of(root, 1))]
    heapq.heapify(heap)
    seen, order = set(), len(heap)
    while heap and len(tokens) < max_nodes:
        neg, _, parent, token, depth = heapq.heappop(heap)
        if (parent, token) in seen:
            continue
        seen.add((parent, token))
        node = len(tokens)
        tokens.append(token), parents.append(parent), values.append(-neg)
        if depth < max_depth:
            for t, p in children_of(token, depth + 1):
                order += 1
                heapq.heappush(heap, (neg * p, order, node, t, depth + 1))
    return Draft(tokens, parents=parents, values=values)


def prune(draft: Draft, n: int) -> Draft:
    """The first n nodes of a best-first tree (closed under ancestors)."""
    if not draft.is_tree or n >= len(draft.tokens):
        return draft
    return Draft(draft.tokens[:n], parents=draft.parents[:n], values=draft.values[:n] if draft.values else None,
                 by=draft.by)


def merge(first: Draft, second: Draft, max_nodes: int) -> Draft:
    """One tree from two (a chain counts as a one-branch tree): `first`'s nodes, then `second`'s that it lacks,
    up to max_nodes. Shared prefixes are verified once."""
    tokens, parents, values = [], [], []
    index: dict[tuple[int, int], int] = {}
    for d in (first, second):
        ps = d.parents if d.is_tree else chain_parents(len(d.tokens))
        vs = d.values or [1.0] * len(d.tokens)
        mine: dict[int, int] = {}
        for i, (t, p) in enumerate(zip(d.tokens, ps)):
            parent = -1 if p < 0 else mine.get(p)
            if parent is None:
                continue  # its parent did not fit
            key = (parent, t)
            if key not in index:
                if len(tokens) >= max_nodes:
                    continue
                index[key] = len(tokens)
                tokens.append(t), parents.append(parent), values.append(vs[i])
            mine[i] = index[key]
    return Draft(tokens, parents=parents, values=values, by=first.by or second.by)
