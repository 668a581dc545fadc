"""Sampling parameters, the logit warping shared by target (p) and draft (q), and the two sources of randomness.

The speculative-sampling guarantee only holds when p and q are warped identically
(temperature, then min-p, top-k, top-p) before the acceptance test.

Randomness:
- no seed: a private torch.Generator, consumed in order; speculation verifies by rejection sampling
  (verification.sample_verify, min(1, p/q) then norm(max(0, p-q))).
- a seed: PositionNoise, one exponential race per sequence position, E_t(v) ~ Exp(1) drawn from (seed, t, v). The
  token at position t is argmax_v p_t(v) / E_t(v), an exact sample from p_t (the exponential-race form of the
  Gumbel-max trick), independent of everything before t. A draft is accepted when it equals that token, and a
  sampling draft races on the same E_t (Gumbel coupling). The text is then a function of (seed, prompt) alone: the
  same whatever the drafter, τ, policy or the requests batched beside it.
"""
from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass, field

import torch

from .errors import InvalidRequest
from .kernels import race
from .kernels.reference.selection import uniforms


MAX_TEMPERATURE = 2.0  # OpenAI's bound
SEED_RANGE = 2**64  # torch.Generator.manual_seed takes [0, 2^64); other seeds are reduced into it (seed mod 2^64)


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0  # 0 = greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 = off
    seed: int | None = None
    min_p: float = 0.0  # 0 = off: keep the tokens at least min_p times as likely as the likeliest (after temperature)
    # the request's penalties (penalties.Penalties) for a model draft to adjust its own rows alike; the target's rows
    # are adjusted through the request's constraint, so this changes no output, only what a draft proposes
    penalties: object = field(default=None, compare=False, repr=False)

    def __post_init__(self):
        if not isinstance(self.temperature, (int, float)) or isinstance(self.temperature, bool) \
                or not 0 <= self.temperature <= MAX_TEMPERATURE:
            raise InvalidRequest(f"temperature must be in [0, {MAX_TEMPERATURE:g}], got {self.temperature!r}")
        if not isinstance(self.top_p, (int, float)) or not 0 < self.top_p <= 1 or math.isnan(self.top_p):
            raise InvalidRequest(f"top_p must be in (0, 1], got {self.top_p!r}")
        if not isinstance(self.top_k, int) or isinstance(self.top_k, bool) or not 0 <= self.top_k < 2**31:
            raise InvalidRequest(f"top_k must be an integer in [0, 2^31), got {str(self.top_k)[:40]}")
        if not isinstance(self.min_p, (int, float)) or isinstance(self.min_p, bool) or not 0 <= self.min_p <= 1:
            raise InvalidRequest(f"min_p must be in [0, 1], got {str(self.min_p)[:40]}")
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
    """Exp(1) noise per (seed, sequence position, token): E = -log u, u = splitmix64(key(seed, position) + (token + 1)
    · golden) as a float in (0, 1). A counter-based generator: any token's noise is computed on its own, so the race
    winner is found with a handful of logarithms (kernels.race) instead of one draw per vocabulary entry."""

    KEEP = 64  # positions whose keys are kept

    def __init__(self, seed: int):
        self.seed = seed
        self._keys: dict[int, int] = {}

    @classmethod
    def fresh(cls) -> PositionNoise:
        """Noise under a seed drawn from torch's global RNG (unseeded requests that verify trees)."""
        return cls(int(torch.randint(0, 2**62, (1,)).item()))

    def key(self, position: int) -> int:
        """The position's 64-bit key (unsigned), from the seed and the position alone."""
        hit = self._keys.get(position)
        if hit is None:
            hit = int.from_bytes(hashlib.blake2b(f"{self.seed}:{position}".encode(), digest_size=8).digest(), "little")
            if len(self._keys) >= self.KEEP:
                self._keys.pop(next(iter(self._keys)))
            self._keys[position] = hit
        return hit

    def exponentials(self, position: int, tokens: torch.Tensor) -> torch.Tensor:
        """E for the given token ids at `position` (float64)."""
        return -torch.log(uniforms(self.key(position), tokens))

    def pick(self, probs: torch.Tensor, positions) -> list[int]:
        """probs [n, V], one row per position in `positions` (repeats allowed: sibling nodes of a tree) -> each row's
        race winner argmax_v p(v) / E(v): an exact sample from the row, fixed by the seed and the position alone."""
        return race(probs, [self.key(t) for t in positions])


def seed_from_os() -> None:
    """Seed torch's global RNG, which unseeded requests draw their private seeds from, with the OS's entropy: torch
    starts every process from one fixed seed, so the k-th unseeded request after every restart (and on every replica)
    sampled the same text. Called once by the processes that serve (generate, serve, each Ray replica)."""
    import secrets
    torch.manual_seed(secrets.randbits(63))


def token_logprobs(logits: torch.Tensor, tokens: list[int], params: SamplingParams, top: int) -> list:
    """[logprob of tokens[i] at row i, [(token, logprob) of the row's `top` likeliest]] per row: the target's own
    distribution as the request samples from it (warp: temperature, top-k, top-p; a grammar's mask already in the
    rows), or for greedy requests the unwarped softmax (temperature 0 has no distribution to report)."""
    out = []
    for i, t in enumerate(tokens):  # a row at a time: a softmax over several rows may sum each in another order
        x = logits[i: i + 1].double()
        row = (torch.log_softmax(x, -1) if params.greedy else torch.log(warp(x, params)))[0]
        entry = [float(row[t]), []]
        if top:
            vals, idx = row.topk(min(top, row.shape[-1]))
            entry[1] = [(int(i), float(v)) for i, v in zip(idx, vals) if v > float("-inf")]  # sampleable only
        out.append(entry)
    return out


def draw(probs: torch.Tensor, generator, position: int) -> int:
    """One token from probs [V] for sequence position `position` (the position matters to PositionNoise only)."""
    if isinstance(generator, PositionNoise):
        return generator.pick(probs[None], [position])[0]
    return int(torch.multinomial(probs, 1, generator=generator))


def warp(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Logits [..., V] -> probabilities [..., V] after temperature, min-p, top-k and top-p (in that order, min-p
    where vLLM applies it). The maximum is subtracted before dividing by the temperature: a tiny temperature (1e-308)
    then sends every other logit to -inf (a one-hot of the argmax) instead of overflowing to inf - inf = NaN. Min-p
    keeps v where p(v) >= min_p · max p, that is where the shifted logit is >= log(min_p)."""
    logits = logits.double()
    logits = (logits - logits.amax(-1, keepdim=True)) / params.temperature
    if params.min_p > 0:
        logits = logits.masked_fill(logits < math.log(params.min_p), float("-inf"))
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
