"""selection.h's reference: top-k (descending, ties to the lower index) with each row's log-sum-exp (simd's vexp
over whole chunks of 16 from the top value, the lane tree, then libm's expf on the tail and logf), argmax
(torch's rule: the first maximum, a NaN counting as the maximum), and seeded sampling's exponential race with its
counter-based noise (sampling.PositionNoise): argmax_v p_v / -log u_v, the first on ties."""
from __future__ import annotations

import ctypes
import ctypes.util
import math

import numpy as np
import torch

from .simd import F32, vexp, vsum

GOLDEN, MIX1, MIX2 = 0x9E3779B97F4A7C15, 0xBF58476D1CE4E5B9, 0x94D049BB133111EB  # splitmix64's constants

_libm = ctypes.CDLL(ctypes.util.find_library("m") or "libm.so.6")
for _name in ("expf", "logf"):
    getattr(_libm, _name).argtypes, getattr(_libm, _name).restype = [ctypes.c_float], ctypes.c_float


def topk(x: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(indices int32 [R, k], values [R, k], log-sum-exp [R]) of each row of x [R, V] (fp32)."""
    x = np.asarray(x, F32)
    R, V = x.shape
    idx = np.argsort(-x, axis=1, kind="stable")[:, :k].astype(np.int32)
    val = np.take_along_axis(x, idx.astype(np.int64), 1)
    lse = np.empty(R, F32)
    for r in range(R):
        mx = val[r, 0]
        whole = V // 16 * 16
        e = vexp(x[r, :whole] - mx).reshape(-1, 16)
        sums = np.zeros(16, F32)
        for c in e:
            sums = sums + c
        total = vsum(sums)
        for i in range(whole, V):
            total = F32(total + F32(_libm.expf(float(x[r, i] - mx))))
        lse[r] = mx + F32(_libm.logf(float(total)))
    return idx, val, lse


def argmax(x: np.ndarray) -> list[int]:
    return [int(i) for i in np.argmax(np.asarray(x), axis=1)]


def as_int64(u: int) -> int:
    """A uint64 as the int64 with the same bits (torch and ctypes take int64)."""
    return u - (1 << 64) if u >= 1 << 63 else u


def uniforms(key: int, tokens: torch.Tensor) -> torch.Tensor:
    """splitmix64 of key + (token + 1)·golden, as ((z >> 11) + 1/2) / 2^53 in (0, 1): torch's int64 arithmetic wraps
    as uint64's does; right shifts are made logical with a mask. The kernels compute the same bits (selection.h)."""
    def srl(z, k):
        return (z >> k) & ((1 << (64 - k)) - 1)
    z = (tokens.long() + 1) * as_int64(GOLDEN) + as_int64(key)
    z = (z ^ srl(z, 30)) * as_int64(MIX1)
    z = (z ^ srl(z, 27)) * as_int64(MIX2)
    z = z ^ srl(z, 31)
    return (srl(z, 11).double() + 0.5) * 2.0 ** -53


def race(p: np.ndarray, keys: list[int]) -> list[int]:
    """Each row's winner argmax_v p_v / -log u_v (libm's log, as the kernel's), the first on ties."""
    out = []
    for row, key in zip(np.asarray(p, np.float64), keys):
        u = uniforms(key, torch.arange(len(row))).tolist()
        scores = [pv / -math.log(uv) for pv, uv in zip(row.tolist(), u)]
        out.append(int(np.argmax(scores)))
    return out
