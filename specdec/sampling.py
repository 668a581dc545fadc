"""Sampling parameters, the logit warping shared by target (p) and draft (q), and the two sources of randomness.

The speculative-sampling guarantee only holds when p and q are warped identically
(temperature, then top-k, then top-p) before the acceptance test.

Randomness:
- no seed: a private torch.Generator, consumed in order; speculation verifies by rejection sampling
  (verification.sample_verify, min(1, p/q) then norm(max(0, p-q))).
- a seed: PositionNoise, one exponential race per sequence position, E_t(v) ~ Exp(1) drawn from (seed, t). The
  token at position t is argmax_v p_t(v) / E_t(v), an exact sample from p_t (the exponential-race form of the
  Gumbel-max trick), independent of everything before t. A draft is accepted when it equals that token, and a
  sampling draft races on the same E_t (Gumbel coupling). The text is then a function of (seed, prompt) alone: the
  same whatever the drafter, τ, policy or the requests batched beside it.
"""
from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass

import torch

from .errors import InvalidRequest


MAX_TEMPERATURE = 2.0  # OpenAI's bound
SEED_RANGE = 2**64  # torch.Generator.manual_seed takes [0, 2^64); other seeds are reduced into it (seed mod 2^64)


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0  # 0 = greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 = off
    seed: int | None = None

    def __post_init__(self):
        if not isinstance(self.temperature, (int, float)) or isinstance(self.temperature, bool) \
                or not 0 <= self.temperature <= MAX_TEMPERATURE:
            raise InvalidRequest(f"temperature must be in [0, {MAX_TEMPERATURE:g}], got {self.temperature!r}")
        if not isinstance(self.top_p, (int, float)) or not 0 < self.top_p <= 1 or math.isnan(self.top_p):
            raise InvalidRequest(f"top_p must be in (0, 1], got {self.top_p!r}")
        if not isinstance(self.top_k, int) or isinstance(self.top_k, bool) or not 0 <= self.top_k < 2**31:
            raise InvalidRequest(f"top_k must be an integer in [0, 2^31), got {str(self.top_k)[:40]}")
        if self.seed is not None and (not isinstance(self.seed, int) or isinstance(self.seed, bool)
                                      or not -SEED_RANGE // 2 <= self.seed < SEED_RANGE):
            raise InvalidRequest(f"seed must be an integer in [-2^63, 2^64), got {str(self.seed)[:40]}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    def generator(self) -> torch.Generator | PositionNoise:
        """A private source of randomness that never disturbs torch's global RNG: PositionNoise when seeded (see
        the module docstring), else a generator seeded from torch's global RNG."""
        if self.seed is not None and not self.greedy:
            return PositionNoise(self.seed)
        g = torch.Generator()
        g.manual_seed(self.seed % SEED_RANGE if self.seed is not None else int(torch.randint(0, 2**62, (1,)).item()))
        return g


class PositionNoise:
    """Exp(1) noise per (seed, sequence position): the randomness of seeded sampling."""

    KEEP = 16  # positions whose noise is kept: a tree's drafter and its verification race on the same ones

    def __init__(self, seed: int):
        self.seed = seed
        self._noise: dict[tuple[int, int], torch.Tensor] = {}

    @classmethod
    def fresh(cls) -> PositionNoise:
        """Noise under a seed drawn from torch's global RNG (unseeded requests that verify trees)."""
        return cls(int(torch.randint(0, 2**62, (1,)).item()))

    def exponentials(self, position: int, vocab: int) -> torch.Tensor:
        hit = self._noise.get((position, vocab))
        if hit is not None:
            return hit
        key = hashlib.blake2b(f"{self.seed}:{position}".encode(), digest_size=8).digest()
        g = torch.Generator().manual_seed(int.from_bytes(key, "little") >> 1)
        e = torch.empty(vocab, dtype=torch.float64).exponential_(generator=g)
        e.clamp_(min=torch.finfo(torch.float64).tiny)  # p/E: a zero-probability token never wins
        if len(self._noise) >= self.KEEP:
            self._noise.pop(next(iter(self._noise)))
        self._noise[(position, vocab)] = e
        return e

    def race(self, probs: torch.Tensor, start: int) -> torch.Tensor:
        """probs [n, V] for positions start..start+n-1 -> scores whose argmax is each position's sampled token."""
        return self.race_at(probs, range(start, start + len(probs)))

    def race_at(self, probs: torch.Tensor, positions) -> torch.Tensor:
        """probs [n, V], one row per position in `positions` (repeats allowed: sibling nodes of a tree)."""
        noise = torch.stack([self.exponentials(t, probs.shape[-1]) for t in positions])
        return probs.double() / noise


def token_logprobs(logits: torch.Tensor, tokens: list[int], params: SamplingParams, top: int) -> list:
    """[logprob of tokens[i] at row i, [(token, logprob) of the row's `top` likeliest]] per row: the target's own
    distribution as the request samples from it (warp: temperature, top-k, top-p; a grammar's mask already in the
    rows), or for greedy requests the unwarped softmax (temperature 0 has no distribution to report)."""
    x = logits[: len(tokens)].double()
    lp = torch.log_softmax(x, -1) if params.greedy else torch.log(warp(x, params))
    out = []
    for row, t in zip(lp, tokens):
        entry = [float(row[t]), []]
        if top:
            vals, idx = row.topk(min(top, row.shape[-1]))
            entry[1] = [(int(i), float(v)) for i, v in zip(idx, vals) if v > float("-inf")]  # sampleable only
        out.append(entry)
    return out


def draw(probs: torch.Tensor, generator, position: int) -> int:
    """One token from probs [V] for sequence position `position` (the position matters to PositionNoise only)."""
    if isinstance(generator, PositionNoise):
        return int(generator.race(probs[None], position).argmax())
    return int(torch.multinomial(probs, 1, generator=generator))


def warp(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Logits [..., V] -> probabilities [..., V] after temperature, top-k and top-p (in that order). The maximum is
    subtracted before dividing by the temperature: a tiny temperature (1e-308) then sends every other logit to -inf
    (a one-hot of the argmax) instead of overflowing to inf - inf = NaN."""
    logits = logits.double()
    logits = (logits - logits.amax(-1, keepdim=True)) / params.temperature
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
