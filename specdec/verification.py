"""Acceptance rules: pure functions over tensors, no models involved.

Shapes: `draft` [k] token ids, `target_logits`/`p` [k+1, V] (row i scores position i of the block, the last row
is the position after the block), `q` [k, V] the distributions the draft sampled from (None = one-hot drafts).
Each returns (n_accepted, next_token): the n accepted draft tokens followed by the target's own token.
"""
from __future__ import annotations

import torch

from .kernels import argmax as row_argmax
from .sampling import PositionNoise, SamplingParams, warp


def choice_rows(logits: torch.Tensor, nodes: list[int], tree: bool, masked: list | None = None) -> torch.Tensor:
    """The rows the emitted tokens were chosen from: a chain's first n + 1; a tree's root row and then each accepted
    node's own row; under a grammar, the masked rows verify_constrained kept."""
    if masked:
        return torch.stack(masked)
    return logits[[0] + [1 + j for j in nodes]] if tree else logits[: len(nodes) + 1]


def greedy_verify(draft: torch.Tensor, target_logits: torch.Tensor, argmax: list[int] | None = None
                  ) -> tuple[int, int]:
    """Accept while the draft token equals the target's argmax; the target's argmax at the first
    mismatch (or after the block) is the correction / bonus token. `argmax`: each row's, when already taken (a batch
    takes every row's at once)."""
    choice = argmax if argmax is not None else row_argmax(target_logits)
    draft = draft.tolist() if isinstance(draft, torch.Tensor) else draft
    n = 0
    while n < len(draft) and draft[n] == choice[n]:
        n += 1
    return n, choice[n]


def acceptance_prob(p_tok: torch.Tensor, q_tok: torch.Tensor) -> torch.Tensor:
    """min(1, p(x)/q(x)) for the drafted x (Leviathan et al. 2023, Alg. 1)."""
    return torch.clamp(p_tok / q_tok, max=1.0)


def residual(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """norm(max(0, p - q)): the distribution to resample from after a rejection.
    If p == q numerically there is nothing left (rejection had probability 0); fall back to p."""
    r = torch.clamp(p - q, min=0)
    total = r.sum(-1, keepdim=True)
    return torch.where(total > 0, r / total.clamp(min=torch.finfo(r.dtype).tiny), p)


def one_hot_q(draft: torch.Tensor, vocab: int, dtype=torch.float64) -> torch.Tensor:
    """q for drafters that propose deterministically (n-gram): all mass on the proposed token."""
    return torch.nn.functional.one_hot(draft, vocab).to(dtype)


def sample_verify(draft: torch.Tensor, q: torch.Tensor | None, p: torch.Tensor,
                  generator: torch.Generator) -> tuple[int, int]:
    """Speculative sampling: the emitted tokens are distributed exactly as sampling from p alone."""
    k = len(draft)
    if k == 0:
        return 0, int(torch.multinomial(p[0], 1, generator=generator))
    q = one_hot_q(draft, p.shape[-1], p.dtype) if q is None else q.to(p.dtype)
    idx = torch.arange(k)
    accept_p = acceptance_prob(p[idx, draft], q[idx, draft])
    u = torch.rand(k, generator=generator, dtype=p.dtype)
    n = int(torch.cumprod((u < accept_p).long(), 0).sum())
    dist = p[k] if n == k else residual(p[n], q[n])
    return n, int(torch.multinomial(dist, 1, generator=generator))


def verify_block(draft: list[int], q: torch.Tensor | None, logits: torch.Tensor, params: SamplingParams,
                 generator, position: int, argmax: list[int] | None = None) -> tuple[int, int]:
    """The rule for this request: greedy, seeded (race) or rejection sampling. `position` is the sequence position
    of the block's first row (the first draft token's); `argmax`: the block's rows' argmax, when already taken."""
    if params.greedy:
        return greedy_verify(draft, logits, argmax)
    tokens = torch.tensor(draft, dtype=torch.long)
    p = warp(logits, params)
    if isinstance(generator, PositionNoise):  # each row's token is argmax p/E: accept drafts while they equal it
        return greedy_verify(tokens, p, generator.pick(p, range(position, position + len(p))))
    return sample_verify(tokens, None if q is None else q[: len(draft)], p, generator)


def verify_tree(tokens: list[int], parents: list[int], logits: torch.Tensor, params: SamplingParams, generator,
                position: int) -> tuple[list[int], int]:
    """A token tree (drafters/tree.py) against logits [1 + n, V]: row 0 scores the position after the context
    (`position`), row 1 + i the position after node i. From the root, follow the child whose token is the target's
    own at its parent's row: the argmax (greedy) or the exponential race's winner (seeded sampling: the winner at a
    position is an exact sample from p there, fixed by the seed and the position alone, so the accepted text is the
    one target-only sampling draws under the same seed). -> (accepted nodes, root to leaf; the target's token after
    them)."""
    from .drafters.tree import depths
    if params.greedy:
        choice = row_argmax(logits)
    elif isinstance(generator, PositionNoise):
        at = [position] + [position + d for d in depths(parents)]
        choice = generator.pick(warp(logits, params), at)
    else:
        raise ValueError("sampled tree verification needs seeded noise (PositionNoise)")
    children: dict[int, list[int]] = {}
    for i, p in enumerate(parents):
        children.setdefault(p, []).append(i)
    accepted, node = [], -1
    while True:
        want = choice[node + 1]
        nxt = next((c for c in children.get(node, []) if tokens[c] == want), None)
        if nxt is None:
            return accepted, want
        accepted.append(nxt)
        node = nxt


def verify_constrained(draft: list[int], logits: torch.Tensor, params: SamplingParams, generator, position: int,
                       constraint, rows: list | None = None) -> tuple[int, int]:
    """A chain under a grammar (constraints.Constraint): row i is masked with the grammar's state after the i
    draft tokens before it, then chosen as target-only would choose from the masked row: the argmax, or the race
    winner at position + i (sampling). Accept while the draft token is that choice. The grammar's state ends after
    the accepted drafts and the target's token. -> (n_accepted, next_token); the masked rows go to `rows`."""
    n = 0
    while True:
        row = constraint.masked(logits[n])
        if rows is not None:
            rows.append(row)
        if params.greedy:
            token = int(row.argmax())
        elif isinstance(generator, PositionNoise):
            token = generator.pick(warp(row[None], params), [position + n])[0]
        else:
            raise ValueError("sampled constrained verification needs seeded noise (PositionNoise)")
        constraint.accept(token)
        if n < len(draft) and draft[n] == token:
            n += 1
            continue
        return n, token


def committed_rows(context_rows: int, nodes: list[int]) -> list[int]:
    """A tree pass's rows whose tokens are committed: the context rows it ran first, then the accepted path's nodes
    (node i is row context_rows + i). Their target features feed a feature draft."""
    return list(range(context_rows)) + [context_rows + i for i in nodes]
