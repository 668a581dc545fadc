"""norms.h in numpy: RMSNorm (Σx² over 16 lanes of FMAs, the lane tree, the tail's squares added one by one,
r = 1 / sqrt(Σ/D + eps), out = w · (x · r)) and the rotary embedding (two products and one add or subtract)."""
from __future__ import annotations

import numpy as np

from .simd import F32, fma32, vsum


def rmsnorm(x: np.ndarray, w: np.ndarray | None, eps: float) -> np.ndarray:
    """Each row of x [R, D] normed by w [D] (None: the rows as they are)."""
    x = np.asarray(x, F32)
    if w is None:
        return x.copy()
    D = x.shape[1]
    full = D // 16 * 16
    chunks = x[:, :full].reshape(len(x), -1, 16)
    acc = np.zeros((len(x), 16), F32)
    for c in range(chunks.shape[1]):
        acc = fma32(chunks[:, c], chunks[:, c], acc)
    ss = vsum(acc)
    for k in range(full, D):
        ss = ss + x[:, k] * x[:, k]
    r = F32(1) / np.sqrt(ss / F32(D) + F32(eps))
    return np.asarray(w, F32)[None] * (x * r[:, None])


def rope(x: np.ndarray, heads: int, hd: int, cos: np.ndarray, sin: np.ndarray, interleaved: bool) -> np.ndarray:
    """x [R, heads·hd] rotated at each row's angles cos, sin [R, hd/2]: pair i is (v[i], v[i + hd/2]), or
    (v[2i], v[2i+1]) in llama.cpp's row order."""
    v = np.asarray(x, F32).reshape(len(x), heads, hd).copy()
    h2 = hd // 2
    ia, ib = (np.arange(0, hd, 2), np.arange(1, hd, 2)) if interleaved else (np.arange(h2), np.arange(h2) + h2)
    a, b = v[..., ia], v[..., ib]
    cs, sn = np.asarray(cos, F32)[:, None], np.asarray(sin, F32)[:, None]
    v[..., ia], v[..., ib] = a * cs - b * sn, b * cs + a * sn
    return v.reshape(len(x), heads * hd)
