"""linear.h's exact linear: per (row m, weight row n) 16 lanes, lane l of chunk c accumulating
fma(x[16c + l], w[16c + l], acc) in column order (a tail of K % 16 columns zero-padded, as masked lanes would be),
the lanes summed in simd's tree, then + bias, then added to the output (acc_out) or stored."""
from __future__ import annotations

import numpy as np

from .formats import dequantize
from .simd import F32, fma32, vsum


def linear(x: np.ndarray, w: np.ndarray, bias: np.ndarray | None = None, out: np.ndarray | None = None) -> np.ndarray:
    """x [R, K] · w [N, K]ᵀ (+ bias) on fp32 weights; `out` [R, N]: the result is added to it (acc_out)."""
    x, w = np.asarray(x, F32), np.asarray(w, F32)
    R, K = x.shape
    pad = -K % 16
    xp = np.pad(x, ((0, 0), (0, pad))).reshape(R, 1, -1, 16)
    wp = np.pad(w, ((0, 0), (0, pad))).reshape(1, len(w), -1, 16)
    acc = np.zeros((R, len(w), 16), F32)
    for c in range(xp.shape[2]):
        acc = fma32(xp[:, :, c], wp[:, :, c], acc)
    s = vsum(acc)
    if bias is not None:
        s = s + np.asarray(bias, F32)[None]
    return s if out is None else out + s


def linear_blocks(fmt: int, x: np.ndarray, data: np.ndarray, n: int, bias=None, out=None) -> np.ndarray:
    """The exact linear on n rows of format `fmt` (their bytes): the dequantized weights in fp32."""
    return linear(x, dequantize(fmt, data, n, np.asarray(x).shape[1]), bias, out)
