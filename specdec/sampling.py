"""Sampling parameters and the logit warping shared by target (p) and draft (q).

The speculative-sampling guarantee only holds when p and q are warped identically
(temperature, then top-k, then top-p) before the acceptance test.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from .errors import InvalidRequest


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0  # 0 = greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 = off
    seed: int | None = None

    def __post_init__(self):
        if not isinstance(self.temperature, (int, float)) or self.temperature < 0:
            raise InvalidRequest(f"temperature must be >= 0, got {self.temperature!r}")
        if not isinstance(self.top_p, (int, float)) or not 0 < self.top_p <= 1:
            raise InvalidRequest(f"top_p must be in (0, 1], got {self.top_p!r}")
        if not isinstance(self.top_k, int) or isinstance(self.top_k, bool) or self.top_k < 0:
            raise InvalidRequest(f"top_k must be an integer >= 0, got {self.top_k!r}")
        if self.seed is not None and (not isinstance(self.seed, int) or isinstance(self.seed, bool)):
            raise InvalidRequest(f"seed must be an integer, got {self.seed!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    def generator(self) -> torch.Generator:
        """A private RNG: seeded runs are reproducible and never disturb torch's global RNG."""
        g = torch.Generator()
        g.manual_seed(self.seed if self.seed is not None else int(torch.randint(0, 2**62, (1,)).item()))
        return g


def warp(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Logits [..., V] -> probabilities [..., V] after temperature, top-k and top-p (in that order)."""
    logits = logits.double() / params.temperature
    if params.top_k and params.top_k < logits.shape[-1]:
        kth = torch.topk(logits, params.top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if params.top_p < 1:
        sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
        sorted_probs = sorted_logits.softmax(-1)
        # keep the smallest prefix whose mass reaches top_p: drop a token when the mass before it already does
        drop_sorted = (sorted_probs.cumsum(-1) - sorted_probs) >= params.top_p
        drop = drop_sorted.scatter(-1, order, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    return logits.softmax(-1)
