"""Token Recycling (Luo et al. 2024, arXiv 2408.08696): every verify pass already computes the target's
distribution after each of its rows' tokens; keep each token's top-k successors from the latest pass that saw it
(a vocab × k table) and draft a tree from that table. No training, nothing to ship, any target: the table fills
as the target runs and stays warm across requests (the server keeps it in a file between runs).

Where the paper drafts a fixed 80-node template, this drafter hands the engine a best-first tree with each node's
estimated acceptance (drafters/tree.py) and the cost model decides how many nodes a pass is worth. The estimate
is calibrated online: how often a successor stored with probability p in a given bucket was the target's token
(greedy and sampled requests apart). Under seeded sampling the candidates race on the request's own noise
(sampling.PositionNoise), so the child proposed first is the likeliest race winner.
"""
from __future__ import annotations

import sys
from pathlib import Path

import torch

from .. import kernels
from ..sampling import PositionNoise
from .base import Draft
from .tenants import PerTenant
from .tree import best_first

TOP_K = 8  # successors kept per token (the paper's k)
MAX_NODES = 16  # the most nodes a proposal offers; the cost model verifies fewer
BUCKETS = 10  # calibration of stored probabilities: [0, 0.1), [0.1, 0.2), ..., [0.9, 1]
PRIOR_WEIGHT = 4.0  # pseudo-observations behind the prior (acceptance = 0.8 · stored p)
FORMAT = 1


class RecycleTable:
    """Successors [V, k] (token ids, -1 = unknown) and their probabilities, plus calibration counts; shared by every
    sequence of a target (forks of a RecycleDrafter)."""

    def __init__(self, vocab: int, k: int = TOP_K, fingerprint: str = ""):
        self.vocab, self.k, self.fingerprint = vocab, k, fingerprint
        self.succ = torch.full((vocab, k), -1, dtype=torch.int32)
        self.prob = torch.zeros((vocab, k), dtype=torch.float32)
        mid = (torch.arange(BUCKETS, dtype=torch.float64) + 0.5) / BUCKETS
        self.offered = torch.full((2, BUCKETS), PRIOR_WEIGHT, dtype=torch.float64)  # [greedy, sampled]
        self.accepted = self.offered * 0.8 * mid

    def rate(self, sampled: bool) -> torch.Tensor:
        """Estimated acceptance by stored-probability bucket."""
        m = int(sampled)
        return self.accepted[m] / self.offered[m]

    def update(self, tokens: list[int], logits: torch.Tensor) -> None:
        """The target's top-k after each token of a pass (rows in order; a token seen twice keeps its last), with
        their probabilities exp(logit - logsumexp) (no full softmax: a pass's rows cost ~0.1 ms here)."""
        succ, prob = kernels.topk(logits[:, : self.vocab], self.k)
        ids = torch.tensor(tokens, dtype=torch.long)
        ok = (ids >= 0) & (ids < self.vocab)
        self.succ[ids[ok]] = succ[ok]
        self.prob[ids[ok]] = prob[ok]

    # ---- persistence -----------------------------------------------------------------------------------------
    def tensors(self, prefix: str = "") -> dict:
        return {prefix + n: getattr(self, n) for n in ("succ", "prob", "offered", "accepted")}

    def save(self, path, others: list[tuple[str, RecycleTable]] = ()) -> None:
        """This table (the default tenant's) and `others` (tenant name, table; drafters/tenants.py) in one file."""
        from safetensors.torch import save_file
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        meta = {"format": str(FORMAT), "vocab": str(self.vocab), "k": str(self.k), "fingerprint": self.fingerprint}
        tensors = self.tensors()
        for name, table in others:
            tensors.update(table.tensors(name + "/"))
        tmp = path.with_suffix(".tmp")
        save_file(tensors, str(tmp), metadata=meta)
        tmp.replace(path)  # a crash mid-write never leaves a torn file

    @classmethod
    def load_or_new(cls, path, vocab: int, fingerprint: str, log=None) -> RecycleTable:
        """The default tenant's table saved at `path` if it is whole and made for this target, else a fresh one
        (saying why)."""
        return load_tables(path, vocab, fingerprint, log).default


def load_tables(path, vocab: int, fingerprint: str, log=None) -> PerTenant:
    """Every tenant's table saved at `path` if the file is whole and made for this target, else fresh ones (saying
    why in one line; an absent file is simply fresh tables)."""
    log = log or (lambda msg: print(msg, file=sys.stderr))
    path = Path(path)
    fresh = PerTenant(lambda: RecycleTable(vocab, fingerprint=fingerprint))
    if not path.exists():
        return fresh
    tables = {}
    try:
        from safetensors import safe_open
        with safe_open(str(path), "pt") as f:
            meta = f.metadata() or {}
            names = {k.rpartition("/")[0] for k in f.keys()}
            t = {name: {n: f.get_tensor(f"{name}/{n}" if name else n) for n in ("succ", "prob", "offered", "accepted")}
                 for name in names}
        k = int(meta.get("k", -1))
        if meta.get("format") != str(FORMAT) or int(meta.get("vocab", -1)) != vocab \
                or meta.get("fingerprint") != fingerprint:
            log(f"specdec: recycle table {path} was made for another target; starting a fresh one")
            return fresh
        for name, tensors in t.items():
            if tensors["succ"].shape != (vocab, k) or tensors["prob"].shape != (vocab, k) \
                    or tensors["offered"].shape != (2, BUCKETS) or tensors["accepted"].shape != (2, BUCKETS):
                raise ValueError("tensor shapes do not match")
            _check_values(tensors, vocab)
            table = tables[name] = RecycleTable(vocab, k, fingerprint)
            table.succ, table.prob = tensors["succ"].int(), tensors["prob"].float()
            table.offered, table.accepted = tensors["offered"].double(), tensors["accepted"].double()
    except Exception as e:  # noqa: BLE001 - any unreadable file: a fresh table, never a crash
        log(f"specdec: recycle table {path} is unreadable ({type(e).__name__}: {str(e)[:80]}); starting a "
            f"fresh one")
        return fresh
    return PerTenant(fresh.make, tables)


def _check_values(t: dict, vocab: int) -> None:
    """A table whose numbers a proposal cannot use (another dtype, NaN, negative counts, successors outside the
    vocabulary) is refused at load: it would make every proposal fail."""
    if t["succ"].dtype not in (torch.int32, torch.int64) or not all(
            t[name].dtype in (torch.float32, torch.float64) for name in ("prob", "offered", "accepted")):
        raise ValueError(f"dtypes {[str(t[n].dtype) for n in ('succ', 'prob', 'offered', 'accepted')]}")
    if int(t["succ"].min()) < -1 or int(t["succ"].max()) >= vocab:
        raise ValueError("successor ids outside the vocabulary")
    prob, counts = t["prob"], torch.cat([t["offered"], t["accepted"]])
    if not (torch.isfinite(prob).all() and (prob >= 0).all() and (prob <= 1).all()):
        raise ValueError("probabilities not in [0, 1]")
    if not (torch.isfinite(counts).all() and (counts >= 0).all() and (t["accepted"] <= t["offered"]).all()):
        raise ValueError("counts not finite and non-negative")


def token_paths(draft: Draft) -> list[tuple[int, ...]]:
    """Each node's tokens from the root's child down to it: what identifies a node across trees."""
    out: list[tuple[int, ...]] = []
    for t, p in zip(draft.tokens, draft.parents):
        out.append((out[p] if p >= 0 else ()) + (t,))
    return out


class RecycleDrafter:
    name = "recycle"
    free = True  # a table lookup per node
    makes_trees = True

    def __init__(self, tables: PerTenant | RecycleTable, path: Path | None = None):
        """`tables`: by tenant (drafters/tenants.py); one table is the default tenant's, the others start empty."""
        if isinstance(tables, RecycleTable):
            t = tables
            tables = PerTenant(lambda: RecycleTable(t.vocab, t.k, t.fingerprint), {"": t})
        self.tables, self.path = tables, path
        self.cache_salt, self.budget = b"", None  # whose request it drafts for (drafters.base.for_request)
        self._last: tuple[dict, bool] | None = None  # the last proposal: token path -> bucket; sampled

    def propose(self, context, k, params, generator) -> Draft:
        t = self.table
        if not context or not 0 <= context[-1] < t.vocab or t.succ[context[-1], 0] < 0:
            return Draft()
        sampled = not params.greedy
        rate = t.rate(sampled).tolist()
        succ_rows, prob_rows = t.succ.numpy(), t.prob.numpy()  # views: row lookups without torch's overhead
        noise = generator if sampled and isinstance(generator, PositionNoise) else None
        buckets: dict[tuple[int, int], int] = {}

        def children(token: int, depth: int):
            succ, prob = succ_rows[token].tolist(), prob_rows[token].tolist()
            pairs = [(s, p) for s, p in zip(succ, prob) if s >= 0]
            if noise is not None and pairs:  # race order on this position's noise: the likeliest winner first
                e = noise.exponentials(len(context) + depth - 1, torch.tensor([tok for tok, _ in pairs])).tolist()
                order = sorted(range(len(pairs)), key=lambda i: -(pairs[i][1] ** (1.0 / params.temperature)) / e[i])
                pairs = [pairs[i] for i in order]
            out = []
            for tok, p in pairs:
                b = min(int(p * BUCKETS), BUCKETS - 1)
                buckets.setdefault((token, tok), b)
                out.append((tok, rate[b]))
            if noise is not None and out:  # the race winner among them is the one to bet on
                out[0] = (out[0][0], max(r for _, r in out))
            return out

        draft = best_first(context[-1], children, MAX_NODES, k)
        paths = token_paths(draft)
        self._last = ({paths[i]: buckets[(paths[i][-2] if len(paths[i]) > 1 else context[-1], t)]
                       for i, t in enumerate(draft.tokens)}, sampled)
        return draft

    def observe_verify(self, context, draft, logits, accepted) -> None:
        """Learn from every pass (whoever drafted it): the successors, and how often our nodes were right."""
        t = self.table
        t.update([context[-1]] + (draft.tokens if draft else []), logits)
        if self._last is None or draft is None or not draft.is_tree:
            return
        mine, sampled = self._last
        self._last = None
        ok, m = set(accepted), int(sampled)
        for i, (p, path) in enumerate(zip(draft.parents, token_paths(draft))):
            b = mine.get(path)  # our node, wherever pruning or merging with other drafts put it
            if b is not None and (p < 0 or p in ok):  # reached: its parent was accepted
                t.offered[m, b] += 1
                t.accepted[m, b] += i in ok

    @property
    def table(self) -> RecycleTable:
        """The table of this request's tenant: the only one its passes teach and its proposals read."""
        return self.tables(self.cache_salt)

    def persist(self) -> None:
        """Write the tables back to the file they came from (drafters.base.save, the server at shutdown)."""
        if self.path is not None:
            self.tables.default.save(self.path, [(n, t) for n, t in self.tables.items() if n])

    def fork(self) -> RecycleDrafter:
        return RecycleDrafter(self.tables, self.path)  # one set of tables; a proposal of its own

    def reset(self) -> None:
        self._last = None
