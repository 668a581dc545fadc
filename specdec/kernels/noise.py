"""The race rule's noise (sampling.PositionNoise), in torch: the reference of the bits rows.cpp's race kernel
computes. splitmix64 of key + (token + 1)·golden, as a uniform in (0, 1)."""
from __future__ import annotations

import torch

GOLDEN, MIX1, MIX2 = 0x9E3779B97F4A7C15, 0xBF58476D1CE4E5B9, 0x94D049BB133111EB  # splitmix64's constants


def as_int64(u: int) -> int:
    """A uint64 as the int64 with the same bits (torch and ctypes take int64)."""
    return u - (1 << 64) if u >= 1 << 63 else u


def uniforms(key: int, tokens: torch.Tensor) -> torch.Tensor:
    """splitmix64 of key + (token + 1)·golden, as ((z >> 11) + 1/2) / 2^53 in (0, 1): torch's int64 arithmetic wraps
    as uint64's does; right shifts are made logical with a mask. The kernels compute the same bits (rows.cpp)."""
    srl = lambda z, k: (z >> k) & ((1 << (64 - k)) - 1)  # noqa: E731
    z = (tokens.long() + 1) * as_int64(GOLDEN) + as_int64(key)
    z = (z ^ srl(z, 30)) * as_int64(MIX1)
    z = (z ^ srl(z, 27)) * as_int64(MIX2)
    z = z ^ srl(z, 31)
    return (srl(z, 11).double() + 0.5) * 2.0 ** -53
