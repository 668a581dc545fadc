"""`A+B`: ask drafter A first and fall back to B when A proposes nothing (e.g. `ngram+<feature draft>`: copy from
the context when an n-gram matches — free to draft — else run the model draft). Target hidden states go to every
member that wants them, each cycle, so a member that was skipped stays in sync.

With a member that makes token trees (recycle), the chain's proposal becomes one tree: the first member's chain
(valued by that member's measured acceptance by depth, Π α_d) merged with the tree-makers' trees, shared prefixes
once (drafters/tree.py); the engine's cost model then verifies the nodes worth their rows."""
from __future__ import annotations

from .base import Draft, close, fork, propose_many
from .tenants import PerTenant
from .tree import chain_parents, merge

PRIOR_ALPHA, DECAY = 0.6, 0.95
MAX_NODES = 16


class ChainDrafter:
    def __init__(self, members: list, alphas: PerTenant | None = None):
        self.members = members
        self.name = "+".join(m.name for m in members)
        self.wants_target_hidden = any(getattr(m, "wants_target_hidden", False) for m in members)
        self.free = all(getattr(m, "free", False) for m in members)
        # free tree-makers (recycle) turn the chain's proposals into merged trees; a model draft's own trees (the
        # feature draft) pass through as they are, and batched requests draft it as chains in one pass for all
        self.makes_trees = any(getattr(m, "makes_trees", False) and getattr(m, "free", False) for m in members)
        # member index -> acceptance by depth [value, weight], by tenant (shared by forks: a drafter's quality
        # carries over to the tenant's next requests; drafters/tenants.py)
        self.alphas = alphas if alphas is not None else PerTenant(dict)
        self.cache_salt, self.budget = b"", None  # whose request it drafts for (drafters.base.for_request)
        self._last: tuple[int, int] | None = None  # (member, chain length) of the last merged proposal

    def propose(self, context, k, params, generator, free_only: bool = False) -> Draft:
        """The first member's proposal that has tokens; `free_only`: only the members before the first model draft
        (a batch proposes those for every request before it splits the pass's rows)."""
        for i, m in enumerate(self.members):
            if free_only and not getattr(m, "free", False):
                break
            branching = self.makes_trees and hasattr(m, "propose_tree")  # several continuations, as one tree
            draft = (m.propose_tree if branching else m.propose)(context, k, params, generator)
            if draft.tokens:
                draft = self._with_trees(i, draft, context, k, params, generator) if self.makes_trees else draft
                draft.by = draft.by or m.name
                return draft
        return Draft()

    def _with_trees(self, i, draft, context, k, params, generator) -> Draft:
        """The member's proposal as a valued tree (a chain by its measured acceptance by depth; a tree by its own
        values), merged with the trees of the tree-making members after it."""
        self._last = None
        tree = draft
        if not draft.is_tree:
            est = self.alphas(self.cache_salt).setdefault(i, [])
            values, v = [], 1.0
            for d in range(len(draft.tokens)):
                v *= est[d][0] if d < len(est) else PRIOR_ALPHA
                values.append(v)
            tree = Draft(draft.tokens, parents=chain_parents(len(draft.tokens)), values=values)
            self._last = (i, len(draft.tokens))
        for m in self.members[i + 1:]:  # free tree-makers only: a model draft runs when those before it had nothing
            if getattr(m, "makes_trees", False) and getattr(m, "free", False):
                tree = merge(tree, m.propose(context, k, params, generator), MAX_NODES)
        return tree

    def observe_verify(self, context, draft, logits, accepted) -> None:
        for m in self.members:
            if hasattr(m, "observe_verify"):
                m.observe_verify(context, draft, logits, accepted)
        if self._last is None or draft is None:
            return
        member, length = self._last
        self._last = None
        est, ok = self.alphas(self.cache_salt).setdefault(member, []), set(accepted)
        for d in range(min(length, len(draft.tokens))):  # the chain's nodes come first, node d at depth d + 1
            if d and d - 1 not in ok:
                break
            if d >= len(est):
                est.append([PRIOR_ALPHA, 1.0])
            a = est[d]
            a[1] = DECAY * a[1] + 1.0
            a[0] += ((d in ok) - a[0]) / a[1]

    @staticmethod
    def propose_many(chains, contexts, ks, params, generators) -> list[Draft]:
        """Each member in turn for the sequences its predecessors proposed nothing for, batched per member."""
        if chains and chains[0].makes_trees:  # (model-free members: one by one costs next to nothing)
            return [c.propose(x, k, p, g) if k else Draft() for c, x, k, p, g in zip(chains, contexts, ks, params,
                                                                                      generators)]
        out, pending = [Draft() for _ in chains], [i for i, k in enumerate(ks) if k]
        for m in range(len(chains[0].members) if chains else 0):
            if not pending:
                break
            drafts = propose_many([chains[i].members[m] for i in pending], [contexts[i] for i in pending],
                                  [ks[i] for i in pending], [params[i] for i in pending],
                                  [generators[i] for i in pending])
            for i, d in zip(pending, drafts):
                d.by = d.by or chains[i].members[m].name
                out[i] = d
            pending = [i for i, d in zip(pending, drafts) if not d.tokens]
        return out

    def observe_target(self, start: int, hidden) -> None:
        for m in self.members:
            if getattr(m, "wants_target_hidden", False):
                m.observe_target(start, hidden)

    def fork(self) -> ChainDrafter:
        return ChainDrafter([fork(m) for m in self.members], self.alphas)

    def close(self) -> None:
        for m in self.members:
            close(m)

    def reset(self) -> None:
        for m in self.members:
            m.reset()
