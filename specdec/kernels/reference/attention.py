"""attention.h in numpy, for one row and the query heads that share one KV head, over the row's logical key
sequence (its slot's positions 0..pos; a tree row's last ones are its path: the same numbers). Scores: one FMA
chain over the dimensions in order, times the scale. A sliding window hides keys before lo = L - window (they
weigh exactly 0; the sums start at lo's 16-aligned block j0). Softmax: exp(s - max) by simd's vexp, summed over
16 lanes for the whole blocks of 16 from j0, the lane tree, then the tail one by one. Values: one FMA chain over
the keys from j0 in order per output, times 1 / Σ."""
from __future__ import annotations

import numpy as np

from .simd import F32, fma32, vexp, vsum


def attend(q: np.ndarray, keys: np.ndarray, values: np.ndarray, window: int = 0, scale: float = 0.0) -> np.ndarray:
    """q [heads, hd], keys and values [L, hd] (as stored: fp16 K/V already widened) -> [heads, hd].
    scale 0: 1/sqrt(hd)."""
    q, keys, values = (np.asarray(a, F32) for a in (q, keys, values))
    heads, hd = q.shape
    L = len(keys)
    lo = L - window if 0 < window < L else 0
    j0 = lo // 16 * 16
    s = F32(scale) if scale > 0 else F32(1) / np.sqrt(F32(hd))
    acc = np.zeros((heads, L), F32)
    for c in range(hd):
        acc = fma32(q[:, c:c + 1], keys[None, :, c], acc)
    p = acc * s
    p[:, j0:lo] = -np.inf
    mx = p[:, lo:].max(1)
    with np.errstate(invalid="ignore"):
        e = vexp(p[:, j0:] - mx[:, None])  # [heads, L - j0]: keys j0..L-1
    whole = (L - j0) // 16  # blocks of 16 keys from j0 that end by L
    sums = np.zeros((heads, 16), F32)
    for b in range(whole):
        sums = sums + e[:, 16 * b: 16 * b + 16]
    total = vsum(sums)
    for j in range(16 * whole, L - j0):
        total = total + e[:, j]
    o = np.zeros((heads, hd), F32)
    for j in range(L - j0):
        o = fma32(e[:, j:j + 1], values[None, j0 + j], o)
    return o * (F32(1) / total)[:, None]
