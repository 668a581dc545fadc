"""`A+B`: ask drafter A first and fall back to B when A proposes nothing (e.g. `ngram+<feature draft>`: copy from
the context when an n-gram matches — free to draft — else run the model draft). Target hidden states go to every
member that wants them, each cycle, so a member that was skipped stays in sync."""
from __future__ import annotations

from .base import Draft, close, fork, propose_many


class ChainDrafter:
    def __init__(self, members: list):
        self.members = members
        self.name = "+".join(m.name for m in members)
        self.wants_target_hidden = any(getattr(m, "wants_target_hidden", False) for m in members)
        self.free = all(getattr(m, "free", False) for m in members)

    def propose(self, context, k, params, generator) -> Draft:
        for m in self.members:
            draft = m.propose(context, k, params, generator)
            if draft.tokens:
                return draft
        return Draft()

    @staticmethod
    def propose_many(chains, contexts, ks, params, generators) -> list[Draft]:
        """Each member in turn for the sequences its predecessors proposed nothing for, batched per member."""
        out, pending = [Draft() for _ in chains], [i for i, k in enumerate(ks) if k]
        for m in range(len(chains[0].members) if chains else 0):
            if not pending:
                break
            drafts = propose_many([chains[i].members[m] for i in pending], [contexts[i] for i in pending],
                                  [ks[i] for i in pending], [params[i] for i in pending],
                                  [generators[i] for i in pending])
            for i, d in zip(pending, drafts):
                out[i] = d
            pending = [i for i, d in zip(pending, drafts) if not d.tokens]
        return out

    def observe_target(self, start: int, hidden) -> None:
        for m in self.members:
            if getattr(m, "wants_target_hidden", False):
                m.observe_target(start, hidden)

    def fork(self) -> ChainDrafter:
        return ChainDrafter([fork(m) for m in self.members])

    def close(self) -> None:
        for m in self.members:
            close(m)

    def reset(self) -> None:
        for m in self.members:
            m.reset()
