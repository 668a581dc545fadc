"""`suffix`: suffix decoding (SuffixDecoding, Oliaro et al. 2024, arXiv 2411.04975; vLLM's `method: "suffix"`).
The longest suffix of the context that occurred before, in this request's prompt and output or in what the server
generated for earlier requests (a bounded store, least recently used first out), and what followed it there.

The draft is long when the match is: up to MATCH_FACTOR tokens per matched token, at most MAX_DEPTH, cut where
the target's measured pass curve stops paying for rows at the acceptance this request has seen after matches of
that length (a longer match is likelier to go on: SuffixDecoding scores its candidates the same way). So an edit
that copies its prompt drafts a line a pass, while a chat with nothing to copy drafts nothing. Model-free: q is
one-hot, and a proposal costs a few numpy scans.
"""
from __future__ import annotations

import io
import json
import sys
from collections import OrderedDict
from pathlib import Path

import numpy as np

from .base import Draft
from .tenants import PerTenant
from .tree import chain_parents, depths, prune

MIN_MATCH = 2  # a single matching token is right too rarely to pay for rows (as ngram's min_ngram)
MAX_MATCH = 64  # the longest context suffix looked up
MAX_DEPTH = 32  # the most tokens one proposal carries
MAX_BRANCHES = 8  # the latest occurrences of a match whose continuations make a greedy request's token tree
MATCH_FACTOR = 2.0  # draft tokens allowed per matched token (SuffixDecoding's max_spec_factor)
BUCKETS = (2, 4, 8, 16)  # match lengths from which each acceptance estimate counts
PRIORS = (0.55, 0.8, 0.9, 0.95)  # acceptance per bucket before this request's first verification there
STORE_TOKENS = 1 << 18  # earlier outputs kept for every request to draw from (a scan of them: ~0.07 ms)


class OutputStore:
    """Outputs of one tenant's earlier requests, searched when a request's own context has no long match: one array
    with a separator between outputs, rebuilt when outputs join or leave (least recently used leave first, past
    STORE_TOKENS). Shared by every fork of a drafter (a server's requests of that tenant: drafters/tenants.py)."""

    def __init__(self, limit: int = STORE_TOKENS):
        self.limit, self.outputs, self.tokens = limit, OrderedDict(), 0
        self._flat, self._owner = np.empty(0, np.int64), np.empty(0, np.int64)

    def add(self, output: list[int]) -> None:
        if len(output) < MIN_MATCH + 1:
            return
        key = tuple(output)
        if key in self.outputs:
            self.outputs.move_to_end(key)
            return
        self.outputs[key] = None
        self.tokens += len(key)
        while self.tokens > self.limit and len(self.outputs) > 1:
            self.tokens -= len(self.outputs.popitem(last=False)[0])
        self._flat = None

    def flat(self) -> np.ndarray:
        """All outputs, each followed by -1 (no token: a match never runs across two outputs)."""
        if self._flat is None:
            parts = [np.asarray(o + (-1,), np.int64) for o in self.outputs]
            self._flat = np.concatenate(parts) if parts else np.empty(0, np.int64)
        return self._flat


def save_stores(stores: PerTenant, path: Path, meta: dict) -> None:
    """Every tenant's outputs, oldest first, as one .npz: `flat` (the default tenant's), `flat.NAME` (each other
    tenant's, by tenants.tenant_name) and `meta` (what target they are for), written atomically."""
    from ..cachedir import write_atomically
    arrays = {("flat." + name if name else "flat"): store.flat() for name, store in stores.items()}
    buf = io.BytesIO()
    np.savez(buf, meta=np.frombuffer(json.dumps(meta).encode(), np.uint8), **arrays)
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    write_atomically(Path(path), buf.getvalue())


def load_stores(path: Path, meta: dict, vocab: int, log=None) -> PerTenant:
    """The tenants' stores saved at `path` if the file is whole and made for this target (`meta`), else none (saying
    why in one line; an absent file is simply new stores)."""
    log = log or (lambda msg: print(msg, file=sys.stderr))
    fresh = PerTenant(OutputStore)
    if not Path(path).exists():
        return fresh
    try:
        with np.load(path, allow_pickle=False) as f:
            saved = json.loads(bytes(f["meta"]).decode())
            flats = {k[5:]: f[k] for k in f.files if k == "flat" or k.startswith("flat.")}
        if saved != meta:
            log(f"specdec: suffix store {path} was made for another target; starting an empty one")
            return fresh
        for flat in flats.values():
            if flat.dtype != np.int64 or flat.ndim != 1 or (len(flat) and (flat.min() < -1 or flat.max() >= vocab
                                                                            or flat[-1] != -1)):
                raise ValueError("not a store of this vocabulary's tokens")
    except Exception as e:  # noqa: BLE001 - any unreadable file: an empty store, never a crash
        log(f"specdec: suffix store {path} is unreadable ({type(e).__name__}: {str(e)[:80]}); starting an "
            f"empty one")
        return fresh
    stores = {}
    for name, flat in flats.items():
        stores[name] = OutputStore()
        for part in np.split(flat, np.flatnonzero(flat < 0) + 1)[:-1]:
            stores[name].add(part[:-1].tolist())
    return PerTenant(OutputStore, stores)


def matches(hay: np.ndarray, tail: np.ndarray, end: int) -> tuple[int, np.ndarray]:
    """(length, starts of what followed each occurrence, in order) of the longest suffix of `tail` (at least
    MIN_MATCH tokens) occurring in hay[:end] with a token after it; (0, []) when none."""
    none = (0, np.empty(0, np.int64))
    if len(tail) < MIN_MATCH or end <= MIN_MATCH:
        return none
    n = MIN_MATCH
    span = hay[:end]
    match = span[: end - n] == tail[-n]
    for j in range(1, n):
        match &= span[j: end - n + j] == tail[-n + j]
    hits = np.flatnonzero(match)  # starts i of tail[-n:] with a follower (i + n < end)
    best = none
    while len(hits):
        best = (n, hits + n)
        if n == len(tail):
            return best
        n += 1
        hits = hits[hits >= 1] - 1  # extend one token to the left
        hits = hits[span[hits] == tail[-n]]
    return best


def longest_match(hay: np.ndarray, tail: np.ndarray, end: int) -> tuple[int, int]:
    """(length, start of what followed) of the longest match (`matches`), its latest occurrence; (0, -1) when
    none."""
    n, starts = matches(hay, tail, end)
    return (n, int(starts[-1])) if n else (0, -1)


def continuation_tree(source: np.ndarray, starts: np.ndarray, depth: int, p: float, max_nodes: int) -> Draft:
    """What followed the latest MAX_BRANCHES occurrences of a match, as one token tree (SuffixDecoding's
    frequency-weighted tree): a node's value is p per level times the share of the occurrences through its parent
    that went on with its token; nodes best-first (parents before children), at most max_nodes. One distinct
    continuation is a chain valued p, p², ..."""
    tokens, parents, values, count, used = [], [], [], [], 0
    child: dict[tuple[int, int], int] = {}
    for s in starts[::-1][:MAX_BRANCHES]:  # latest first: on a tie the latest continuation comes first
        node = -1
        for t in source[s: s + depth].tolist():
            if t < 0:
                break  # the end of a stored output
            key = (node, t)
            if key not in child:
                child[key] = len(tokens)
                tokens.append(t), parents.append(node), count.append(0)
            node = child[key]
            count[node] += 1
        used += node >= 0
    for i, up in enumerate(parents):  # parents come before children: their values are known
        values.append((1.0 if up < 0 else values[up]) * p * count[i] / (used if up < 0 else count[up]))
    # p < 1, so a child is worth less than its parent and sorts after it: any first n nodes keep their ancestors
    order = sorted(range(len(tokens)), key=lambda i: (-values[i], i))[:max_nodes]
    where = {old: new for new, old in enumerate(order)}
    return Draft([tokens[i] for i in order], parents=[-1 if parents[i] < 0 else where[parents[i]] for i in order],
                 values=[values[i] for i in order])


class SuffixDrafter:
    name = "suffix"
    free = True
    sizes_own_depth = True  # the engines ask it for depth(cost) tokens, not τ

    def __init__(self, stores: PerTenant | None = None, path: Path | None = None, meta: dict | None = None):
        """`stores`: earlier outputs by tenant (drafters/tenants.py); None: empty ones."""
        self.stores = stores if stores is not None else PerTenant(OutputStore)
        self.path, self.meta = path, meta or {}  # suffix:FILE keeps the stores there between runs
        self.cache_salt, self.budget = b"", None  # whose request it drafts for (drafters.base.for_request)
        self.reset()

    @property
    def store(self) -> OutputStore:
        """The earlier outputs of this request's tenant: the only ones it may draw from."""
        return self.stores(self.cache_salt)

    def reset(self) -> None:
        """A new request: the last one's output joins the store for later requests."""
        if getattr(self, "_base", None) is not None:
            self.store.add(self._context[self._base:])
        self._base = None  # context length at the first proposal: the output starts there
        self._context: list[int] = []
        self.hits = [p * 4 for p in PRIORS]  # per match-length bucket: accepted / proposed, a prior of four drafts
        self.tries = [4.0] * len(PRIORS)
        self._cost = None  # the target's pass curve (depth)
        self._bucket = 0  # the last proposal's
        self._last = 0  # the last proposal's length
        self._at = None  # (source, index) where the last proposal started in its source
        self._next = None  # where the next proposal starts if the output stays in step with that source
        self._in_step = False

    def fork(self) -> SuffixDrafter:
        return SuffixDrafter(self.stores, self.path, self.meta)  # one set of stores; this request's own state

    def persist(self) -> None:
        """Write the store (and the output under way) to the file it came from (drafters.base.save, the server at
        shutdown)."""
        if self._base is not None:
            self.store.add(self._context[self._base:])
        if self.path is not None:
            save_stores(self.stores, self.path, self.meta)

    def close(self) -> None:
        """The request is over (a batch's fork leaves): its output joins the store."""
        self.reset()

    def acceptance(self) -> float:
        """The acceptance expected of the last proposal: this request's running rate after matches of its length
        (a longer match is at least as reliable as a shorter one); in step with its source, the best it has seen."""
        rates = [h / n for h, n in zip(self.hits, self.tries)]
        return min(0.99, max(rates if self._in_step else rates[: self._bucket + 1]))

    def depth(self, cost) -> int:
        """The engines ask for this many tokens; each proposal is then cut to the chain length that maximises
        expected tokens per unit of pass time (`cost(rows)`, the measured pass curve) at its match's acceptance."""
        self._cost = cost
        return MAX_DEPTH

    def propose(self, context, k, params, generator) -> Draft:
        """The continuation of the longest match, cut where the pass curve stops paying; for a greedy request whose
        match occurred before with different continuations, all of them as one token tree (continuation_tree)."""
        if self._base is None:
            self._base = len(context)
        self._context = list(context)
        a = np.asarray(context, np.int64)
        tail = a[-MAX_MATCH:]
        n, starts = matches(a, tail, len(a))  # earlier occurrences, each with a token after it
        source = a
        if n < MAX_MATCH // 4 and self.store.outputs:  # earlier requests' outputs may match longer
            flat = self.store.flat()
            m, s = matches(flat, tail, len(flat))
            if m > n:
                n, starts, source = m, s, flat
        if not n:
            self._last, self._next = 0, None
            return Draft()
        start = int(starts[-1])  # the latest occurrence
        self._bucket = sum(n >= b for b in BUCKETS) - 1
        # in step: the output went on exactly as the source did after the last proposal (its accepted tokens and the
        # target's own next one): a copy under way, drafted as long as it pays, not only MATCH_FACTOR x its match
        self._in_step = self._next == (id(source) if source is not a else 0, start)
        self._at = (id(source) if source is not a else 0, start)
        limit = min(k, MAX_DEPTH, MAX_DEPTH if self._in_step else max(1, int(MATCH_FACTOR * n)))
        p = self.acceptance()
        follow = source[start: start + limit]
        stop = np.flatnonzero(follow < 0)  # the end of a stored output
        self._follow = (follow[: stop[0]] if len(stop) else follow).tolist()
        if params is not None and params.greedy and len(starts) > 1 and not self._in_step:
            tree = continuation_tree(source, starts, limit, p, MAX_DEPTH)
            if tree.parents != chain_parents(len(tree.tokens)):  # the occurrences went on differently
                if self._cost is not None:  # as many nodes as the pass curve pays for
                    from ..costs import best_tree_size
                    tree = prune(tree, max(1, best_tree_size(tree.values, self._cost)))
                self._last = max(depths(tree.parents))
                return tree
        if self._cost is not None:  # as deep as the pass curve pays for at this match's acceptance
            from ..costs import best_tree_size
            limit = min(limit, max(1, best_tree_size([p ** (i + 1) for i in range(limit)], self._cost)))
        tokens = self._follow[:limit]
        self._last = len(tokens)
        return Draft(tokens)

    def observe_verify(self, context, draft, logits, accepted) -> None:
        """This request's running acceptance per position, for the bucket of the last proposal's match length."""
        if not self._last or draft is None:
            return
        # a position's chance of acceptance (geometric): the accepted ones succeeded, the first rejected one failed,
        # and those after it were never tried (accepted / proposed would read long drafts as half wrong); a tree's
        # accepted path counts as a chain as deep as the tree
        n, b = min(len(accepted), self._last), self._bucket
        self.hits[b], self.tries[b] = 0.8 * self.hits[b] + n, 0.8 * self.tries[b] + n + (n < self._last)
        path = [draft.tokens[i] for i in accepted] if draft.is_tree else self._follow[:n]
        in_step = path == self._follow[:n]  # the latest occurrence's continuation, not another branch's
        self._next = (self._at[0], self._at[1] + n + 1) if in_step else None  # after them and the target's next one
        self._last = 0
