"""`A+B`: ask drafter A first and fall back to B when A proposes nothing (e.g. `ngram+<feature draft>`: copy from
the context when an n-gram matches — free to draft — else run the model draft). Target hidden states go to every
member that wants them, each cycle, so a member that was skipped stays in sync."""
from __future__ import annotations

from .base import Draft, close, fork


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
