"""Our own quantizer to GGUF's K-quant blocks (Q2_K, Q3_K, Q4_K, Q5_K, Q6_K; the 32-column types through gguf's).

For tests and synthetic model files (benchmarks/runtime.py synthetic-gguf): a plain min/max fit per sub-block, not
llama.cpp's error search, in the exact byte layout ggml reads (ggml-common.h block_q*_K). gguf's reference
dequantization reads these bytes back (tests check it), and so do llama.cpp and the runtime's kernels.
"""
from __future__ import annotations

import numpy as np

QK = 256
K_TYPES = {10: "Q2_K", 11: "Q3_K", 12: "Q4_K", 13: "Q5_K", 14: "Q6_K"}


def quantize(w: np.ndarray, fmt: int) -> np.ndarray:
    """w [n, k] fp32 -> uint8 [n, row bytes] in ggml type `fmt` (k a multiple of the type's block)."""
    import gguf
    w = np.ascontiguousarray(w, dtype=np.float32)
    if fmt not in K_TYPES:
        return np.ascontiguousarray(gguf.quants.quantize(w, gguf.GGMLQuantizationType(fmt))).reshape(w.shape[0], -1)
    n, k = w.shape
    if k % QK:
        raise ValueError(f"{K_TYPES[fmt]} rows need a multiple of {QK} columns, got {k}")
    blocks = w.reshape(-1, QK)
    out = {10: _q2_k, 11: _q3_k, 12: _q4_k, 13: _q5_k, 14: _q6_k}[fmt](blocks)
    return np.ascontiguousarray(out).reshape(n, -1)


def _f16(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(fp16 bytes [b, 2], the fp16 value back in fp32 [b, 1])."""
    h = x.astype(np.float16).reshape(-1, 1)
    return h.view(np.uint8).reshape(-1, 2), h.astype(np.float32)


def _div(a, b):
    with np.errstate(divide="ignore", invalid="ignore"):
        return np.where(b == 0, 0, a / np.where(b == 0, 1, b))


def _affine(x: np.ndarray, sub: int, levels: int, bits: int):
    """Unsigned q in [0, levels] with w ≈ d·sc·q - dmin·m per sub-block of `sub` columns; sc, m in [0, 2^bits)."""
    b = x.shape[0]
    xs = x.reshape(b, -1, sub)
    lo = np.minimum(xs.min(-1), 0)
    scale = (xs.max(-1) - lo) / levels
    top = (1 << bits) - 1
    dbytes, d = _f16(scale.max(-1) / top)
    mbytes, dmin = _f16(-lo.min(-1) / top)
    sc = np.clip(np.rint(_div(scale, d)), 0, top)
    m = np.clip(np.rint(_div(-lo, dmin)), 0, top)
    step = (d * sc)[..., None]
    q = np.clip(np.rint(_div(xs + (dmin * m)[..., None], step)), 0, levels).astype(np.uint8)
    return q.reshape(b, QK), sc.astype(np.uint8), m.astype(np.uint8), dbytes, mbytes


def _symmetric(x: np.ndarray, sub: int, qmax: int, scmax: int):
    """Signed q in [-qmax, qmax - 1] with w ≈ d·sc·q per sub-block of `sub` columns; sc in [-scmax, scmax]."""
    b = x.shape[0]
    xs = x.reshape(b, -1, sub)
    scale = np.abs(xs).max(-1) / qmax
    dbytes, d = _f16(scale.max(-1) / scmax)
    sc = np.clip(np.rint(_div(scale, d)), -scmax, scmax)
    q = np.clip(np.rint(_div(xs, (d * sc)[..., None])), -qmax, qmax - 1).astype(np.int16)
    return q.reshape(b, QK), sc.astype(np.int16), dbytes


def _scales_k4(sc: np.ndarray, m: np.ndarray) -> np.ndarray:
    """8 six-bit scales and mins -> the 12 bytes ggml's get_scale_min_k4 reads."""
    out = np.zeros((sc.shape[0], 12), np.uint8)
    out[:, 0:4] = sc[:, :4] | ((sc[:, 4:] >> 4) << 6)
    out[:, 4:8] = m[:, :4] | ((m[:, 4:] >> 4) << 6)
    out[:, 8:12] = (sc[:, 4:] & 15) | ((m[:, 4:] & 15) << 4)
    return out


def _nibbles_k(q: np.ndarray) -> np.ndarray:
    """Q4_K/Q5_K quants [b, 256] (low 4 bits) -> 128 bytes: sub-block 2g in byte group g's low nibbles, 2g+1 high."""
    g = (q & 15).reshape(-1, 4, 2, 32)
    return (g[:, :, 0] | (g[:, :, 1] << 4)).reshape(-1, 128)


def _crumbs(q: np.ndarray) -> np.ndarray:
    """2-bit fields [b, 256] -> 64 bytes: element h·128 + t·32 + i at byte h·32 + i, bits 2t."""
    g = q.reshape(-1, 2, 4, 32).astype(np.uint8)
    return (g[:, :, 0] | g[:, :, 1] << 2 | g[:, :, 2] << 4 | g[:, :, 3] << 6).reshape(-1, 64)


def _q4_k(x):
    q, sc, m, d, dmin = _affine(x, 32, 15, 6)
    return np.concatenate([d, dmin, _scales_k4(sc, m), _nibbles_k(q)], -1)


def _q5_k(x):
    q, sc, m, d, dmin = _affine(x, 32, 31, 6)
    bits = (q >> 4).reshape(-1, 8, 32)  # bit j of byte i: sub-block j's column i
    qh = np.zeros((x.shape[0], 32), np.uint8)
    for j in range(8):
        qh |= bits[:, j] << j
    return np.concatenate([d, dmin, _scales_k4(sc, m), qh, _nibbles_k(q)], -1)


def _q2_k(x):
    q, sc, m, d, dmin = _affine(x, 16, 3, 4)
    return np.concatenate([sc | (m << 4), _crumbs(q), d, dmin], -1)


def _q6_k(x):
    q, sc, d = _symmetric(x, 16, 32, 127)
    u = (q + 32).astype(np.uint8).reshape(-1, 2, 2, 64)  # element h·128 + s·64 + i
    ql = ((u[:, :, 0] & 15) | ((u[:, :, 1] & 15) << 4)).reshape(-1, 128)
    qh = _crumbs((q + 32).astype(np.uint8) >> 4)
    return np.concatenate([ql, qh, sc.astype(np.int8).view(np.uint8), d], -1)


def _q3_k(x):
    q, sc, d = _symmetric(x, 16, 4, 31)
    u = (q + 4).astype(np.uint8)  # q = (u & 3) - 4 + 4·(u >> 2)
    hbit = (u >> 2).reshape(-1, 8, 32)
    hmask = np.zeros((x.shape[0], 32), np.uint8)
    for t in range(8):
        hmask |= hbit[:, t] << t
    s6 = (sc + 32).astype(np.uint8)
    scales = np.zeros((x.shape[0], 12), np.uint8)
    for j in range(16):
        scales[:, j % 8] |= (s6[:, j] & 15) << (4 * (j // 8))
        scales[:, 8 + j % 4] |= (s6[:, j] >> 4) << (2 * (j // 4))
    return np.concatenate([hmask, _crumbs(u & 3), scales, d], -1)
