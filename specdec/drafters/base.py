"""The drafter seam: propose k tokens after a context, with the distributions they were sampled from."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

import torch

from ..sampling import SamplingParams


@dataclass
class Draft:
    """A chain of tokens, or with `parents` a token tree: node i continues node parents[i] (-1: the context's last
    token), parents[i] < i. `values` (trees) are the drafter's estimates that each node is accepted, its path
    included: what the cost model sizes a tree by (drafters/tree.py)."""
    tokens: list[int] = field(default_factory=list)
    q: torch.Tensor | None = None  # [len(tokens), V] warped draft probabilities; None = deterministic (one-hot)
    parents: list[int] | None = None
    values: list[float] | None = None
    match: int = 0  # a model-free copy: how many context tokens matched before its source (its estimates' bucket)
    # of the drafting time, the ms a model draft spent catching up on a stretch it had not seen (the prompt, or
    # tokens other drafters proposed): paid once, not per drafted token, so the cost estimates leave it out
    prefill_ms: float = 0.0
    by: str | None = None  # the drafter that proposed it (a chain's member; drafters.chain sets it)

    @property
    def is_tree(self) -> bool:
        return self.parents is not None


class Drafter(Protocol):
    name: str

    def propose(self, context: list[int], k: int, params: SamplingParams, generator: torch.Generator) -> Draft:
        """Up to k tokens continuing `context` (the committed sequence). May return fewer, even none."""

    def reset(self) -> None:
        """Forget all state from earlier generations."""


class NoDrafter:
    """`none`: proposes nothing, so every cycle is one plain target step (the baseline, same code path)."""

    name = "none"
    free = True  # model-free: proposing costs next to nothing

    def propose(self, context, k, params, generator) -> Draft:
        return Draft()

    def reset(self) -> None:
        pass


def fork(drafter):
    """A drafter for one more concurrent sequence: the same weights and tables, its own state (caches, target
    features). Model-free drafters keep no state between calls and serve every sequence as they are."""
    return drafter.fork() if hasattr(drafter, "fork") else drafter


def for_request(drafter, salt: bytes, budget: tuple[int, float] | None = None) -> None:
    """Tell a request's drafter (a chain and its members) whose request it drafts for, and its `budget` = (tokens it may
    emit, a callable giving the ms a drafted-for token saves now): a model draft's cached prompts are found only within
    one tenant, and it puts off a catch-up the budget cannot repay (drafters/draft_cache.py)."""
    for member in [drafter, *getattr(drafter, "members", [])]:
        if hasattr(member, "cache_salt"):
            member.cache_salt, member.budget = salt, budget


def put_off(drafter) -> bool:
    """Whether a drafter's (a chain's members') model draft put off its catch-up: it drafts nothing after the split."""
    return any(getattr(m, "put_off", False) for m in [drafter, *getattr(drafter, "members", [])])


def reconsider(drafter, context) -> None:
    """A drafter's (a chain's members') put-off model draft weighed again at the load now (ModelDrafter.reconsider)."""
    for m in [drafter, *getattr(drafter, "members", [])]:
        if getattr(m, "put_off", False) and hasattr(m, "reconsider"):
            m.reconsider(context)


def catch_up_ms(drafter, context) -> float:
    """What a drafter's (a chain's members') model draft would first spend catching up on `context`
    (ModelDrafter.catch_up_ms); 0 for drafters without one."""
    return sum(m.catch_up_ms(context) for m in [drafter, *getattr(drafter, "members", [])] if hasattr(m, "catch_up_ms"))


def draft_caches(drafter) -> list:
    """A model draft's caches (drafters/draft_cache.py), of the drafter or its chain's members."""
    return [c for m in getattr(drafter, "members", [drafter]) if (c := getattr(m, "draft_cache", None)) is not None]


def idle_work(drafter) -> int:
    """A drafter's (a chain's members') work for idle time: a model draft's put-off catch-ups, queued or under way."""
    return sum(c.idle_work() for c in draft_caches(drafter))


def idle_step(drafter) -> bool:
    """One step of that work -> whether any remains."""
    for c in draft_caches(drafter):
        if c.idle_work():
            c.idle_step()
            break
    return idle_work(drafter) > 0


def save(drafter) -> None:
    """Write what a drafter learned to keep (recycle's table) where it came from; chains save every member. Only
    drafters with `persist()` learn anything (a datastore's `save` builds a new one from sequences)."""
    for member in getattr(drafter, "members", [drafter]):
        if hasattr(member, "persist"):
            member.persist()


def makes_trees(drafter) -> bool:
    """Whether the drafter, or a member of a chain, proposes token trees (a sampled request then verifies by the
    race rule, on PositionNoise)."""
    return any(getattr(m, "makes_trees", False) for m in getattr(drafter, "members", [drafter]))


def close(drafter) -> None:
    """Give back what a forked drafter holds (KV slots)."""
    if hasattr(drafter, "close"):
        drafter.close()


def propose_many(drafters, contexts, ks, params, generators) -> list[Draft]:
    """Drafts for several sequences, each with its own drafter (forks of one): batched where the drafter type
    batches (FeatureDrafter, ChainDrafter), else one by one. A k of 0 gets an empty draft."""
    if drafters and hasattr(type(drafters[0]), "propose_many"):
        return type(drafters[0]).propose_many(drafters, contexts, ks, params, generators)
    return [d.propose(c, k, p, g) if k else Draft() for d, c, k, p, g in zip(drafters, contexts, ks, params,
                                                                             generators)]
