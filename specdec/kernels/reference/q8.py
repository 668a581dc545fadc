"""q8_repack.h's and q8_linear.h's arithmetic in numpy: each row quantized to int8 per 32-column block
(s = max|x| / 127, q = round-half-even(x·127/max|x|)), every weight format rebuilt as the q8 layout it runs as
(FORMAT_TABLE's q8 column), exact integer block sums, then one fp32 chain per output over the blocks in order:
acc = fma(isum, d·s, acc) (Q4_1's layout: then acc = fma(m, s·Σq, acc); the 16-column halves of Q6_K, Q3_K and
Q2_K each with their own scale, Q2_K adding its mins), + bias. Every layout but Q4_0's, Q8_0's, Q4_K's and Q6_K's holds its scales
and mins times UP = 2^8 in fp16, and the chain's result is multiplied by 1 / UP (q8_repack.h's Q8_SCALE_UP)."""
from __future__ import annotations

import gguf
import numpy as np

from .. import formats as kernels  # the type ids, under the name the kernels' code reads them by
from .simd import F32, fma32

T = gguf.GGMLQuantizationType
BLOCK = {kernels.Q4_0: 18, kernels.Q4_1: 20, kernels.Q8_0: 34}
UP = F32(256)  # Q8_SCALE_UP


def fp16_up(v) -> np.ndarray:
    """A computed scale as the repack stores it: fp32 v times UP, rounded to fp16 (read back as fp32)."""
    return (np.asarray(v, F32) * UP).astype(np.float16).astype(F32)


def weights_of(fmt, data: np.ndarray, n: int, k: int):
    """Integer weights [n, k] (Q4_0 already minus 8), d [n, nb] and m [n, nb] (Q4_1: both times UP) from the raw
    blocks."""
    nb = k // 32
    blocks = data.reshape(n, nb, BLOCK[fmt])
    d = blocks[..., :2].copy().view(np.float16).astype(F32)[..., 0]
    if fmt == kernels.Q8_0:
        return blocks[..., 2:].copy().view(np.int8).astype(np.int64).reshape(n, k), d, None
    off = 4 if fmt == kernels.Q4_1 else 2
    packed = blocks[..., off:].astype(np.int64)
    q = np.concatenate([packed & 15, packed >> 4], -1).reshape(n, k)
    if fmt == kernels.Q4_0:
        return q - 8, d, None
    return q, d * UP, blocks[..., 2:4].copy().view(np.float16).astype(F32)[..., 0] * UP


def q8_reference(fmt, x: np.ndarray, data: np.ndarray, n: int, k: int, bias=None, weights=None) -> np.ndarray:
    """The q8 linear in numpy, operation for operation as rows.cpp does it: per block an exact integer dot product,
    then one fp32 chain per output over the blocks in order, acc = fma(isum, d·s, acc) (Q4_1: then
    acc = fma(m, s·Σq, acc)), + bias."""
    qw, dw, mw = weights if weights is not None else weights_of(fmt, data, n, k)
    nb = k // 32
    xb = x.astype(F32).reshape(len(x), nb, 32)
    amax = np.abs(xb).max(2)
    s = (amax / F32(127)).astype(F32)
    inv = np.where(amax > 0, F32(127) / np.where(amax > 0, amax, F32(1)), F32(0)).astype(F32)
    q = np.rint(xb * inv[..., None]).astype(np.int64)  # [R, nb, 32]; rint: half to even, as the kernel rounds
    sq = (s * q.sum(2).astype(F32)).astype(F32)
    isum = np.einsum("rbi,nbi->rnb", q, qw.reshape(n, nb, 32))  # [R, n, nb], exact in int64
    acc = np.zeros((len(x), n), F32)
    for b in range(nb):
        acc = fma32(isum[..., b].astype(F32), (dw[None, :, b] * s[:, None, b]).astype(F32), acc)
        if mw is not None:
            acc = fma32(np.broadcast_to(mw[None, :, b], acc.shape), np.broadcast_to(sq[:, None, b], acc.shape), acc)
    if fmt == kernels.Q4_1:  # Q4_0's, Q8_0's and Q4_K's scales are not scaled up (the Q4_1 sums' other users)
        acc = (acc * (F32(1) / UP)).astype(F32)
    return acc if bias is None else (acc + bias.astype(F32)[None]).astype(F32)


def halves_reference(x: np.ndarray, q: np.ndarray, dsc: np.ndarray, mins=None, up: bool = True) -> np.ndarray:
    """Q6_K's / Q3_K's / Q2_K's q8 linear in numpy: per 32-column block of x (quantized as for every format), each
    16-column half's exact integer dot product, then acc = fma(isum_a, d_a·s, acc), acc = fma(isum_b, d_b·s, acc),
    and for Q2_K acc = fma(m_a, s·Σx_a, acc), acc = fma(m_b, s·Σx_b, acc), in block order; `up`: d, m are times UP
    (Q3_K's, Q2_K's fp16 scales), and then acc / UP (Q6_K: its fp32 d·sc as they are)."""
    n, k = q.shape
    nb = k // 32
    xb = x.astype(F32).reshape(len(x), nb, 32)
    amax = np.abs(xb).max(2)
    s = (amax / F32(127)).astype(F32)
    inv = np.where(amax > 0, F32(127) / np.where(amax > 0, amax, F32(1)), F32(0)).astype(F32)
    xq = np.rint(xb * inv[..., None]).astype(np.int64).reshape(len(x), nb * 2, 16)
    isum = np.einsum("rhi,nhi->rnh", xq, q.reshape(n, nb * 2, 16))
    dh = dsc.reshape(n, nb * 2)
    xsum = xq.sum(2).astype(F32)  # [R, 2 nb]
    acc = np.zeros((len(x), n), F32)
    for b in range(nb):
        for h in (2 * b, 2 * b + 1):
            acc = fma32(isum[..., h].astype(F32), (dh[None, :, h] * s[:, None, b]).astype(F32), acc)
        if mins is not None:
            mh = mins.reshape(n, nb * 2)
            for h in (2 * b, 2 * b + 1):
                sx = np.broadcast_to((s[:, None, b] * xsum[:, None, h]).astype(F32), acc.shape)
                acc = fma32(np.broadcast_to(mh[None, :, h], acc.shape), sx, acc)
    return (acc * (F32(1) / UP)).astype(F32) if up else acc


def as_q8_layout(fmt, data: np.ndarray, n: int, k: int) -> tuple[int, np.ndarray]:
    """What the q8 mode runs a tensor as, rebuilt in numpy from the file's bytes: Q5_0 -> Q8_0 blocks (d, q - 16;
    the kernel keeps Q5_0's own bytes and sums q from -16·Σx: the same integers);
    Q5_K, Q5_1 -> Q4_1's sums on (q [n, k], d, m per 32 columns: fp16 of d·sc and of -dmin·m, times UP); Q4_K ->
    the same sums on its own scales, d·sc and -dmin·m in fp32 (exact products, nothing rounded);
    Q3_K, Q2_K -> (q, fp16 d·sc per 16 columns[, fp16 -dmin·m]), times UP; Q6_K -> (q, fp32 d·sc per 16 columns:
    exact products)."""
    if fmt in (kernels.Q3_K, kernels.Q2_K):  # (q [n, k], fp16 d·sc per 16 columns[, fp16 -dmin·m])
        sbytes = 110 if fmt == kernels.Q3_K else 84
        sb = data.reshape(n, k // 256, sbytes)

        def crumbs(b):  # 2-bit fields: byte i's bits 2j..2j+1 are quant 32j + i of its 128-quant half
            return (b.reshape(n, -1, 2, 1, 32) >> np.array([0, 2, 4, 6], np.uint8).reshape(1, 1, 1, 4, 1)) & 3
        if fmt == kernels.Q3_K:
            hbit = (sb[..., :32].reshape(n, -1, 1, 32) >> np.arange(8, dtype=np.uint8).reshape(1, 1, 8, 1)) & 1
            q = crumbs(sb[..., 32:96]).reshape(n, -1, 256).astype(np.int64) - 4 + 4 * hbit.reshape(n, -1, 256)
            lo = (sb[..., 96:104].reshape(n, -1, 1, 8) >> np.array([0, 4], np.uint8).reshape(1, 1, 2, 1)) & 15
            hi = (sb[..., 104:108].reshape(n, -1, 1, 4) >> np.array([0, 2, 4, 6], np.uint8).reshape(1, 1, 4, 1)) & 3
            sc = (lo.reshape(n, -1, 16) | hi.reshape(n, -1, 16) << 4).astype(F32) - 32
            d = sb[..., 108:110].copy().view(np.float16).astype(F32)
            return kernels.Q3_K, (q.reshape(n, k), fp16_up(d * sc), None)
        q = crumbs(sb[..., 16:80]).reshape(n, k).astype(np.int64)
        d, dmin = (sb[..., a:a + 2].copy().view(np.float16).astype(F32) for a in (80, 82))
        dsc = fp16_up(d * (sb[..., :16] & 15).astype(F32))
        mins = fp16_up(-(dmin * (sb[..., :16] >> 4).astype(F32)))
        return kernels.Q2_K, (q, dsc, mins)
    if fmt == kernels.Q6_K:  # (fp16 d·sc of each 16 columns, q) -> reference arrays, not blocks
        blocks = data.reshape(n, k // 256, 210)
        d = blocks[..., 208:210].copy().view(np.float16).astype(F32)
        sc = blocks[..., 192:208].copy().view(np.int8).astype(F32)
        q = gguf.quants.dequantize(data, T.Q6_K).reshape(n, k // 256, 16, 16) / (d * sc)[..., None]
        return kernels.Q6_K, (np.rint(q).astype(np.int64).reshape(n, k), (d * sc).astype(F32), None)
    if fmt in (kernels.Q5_1, kernels.Q5_K):  # -> (q [n, k] in [0, 31], d, m per 32 columns): Q4_1's sums
        if fmt == kernels.Q5_1:
            blocks = data.reshape(n, k // 32, 24)
            d, m = (blocks[..., a:a + 2].copy().view(np.float16).astype(F32)[..., 0] * UP for a in (0, 2))
            qh = blocks[..., 4:8].copy().view(np.uint32)
            low = np.concatenate([blocks[..., 8:] & 15, blocks[..., 8:] >> 4], -1).astype(np.int64)
            q = low | ((qh >> np.arange(32, dtype=np.uint32)) & 1).astype(np.int64) << 4
        else:
            sb = data.reshape(n, k // 256, 176)
            d0, dmin = (sb[..., a:a + 2].copy().view(np.float16).astype(F32) for a in (0, 2))
            sc, mn = (v.reshape(n, -1, 8).astype(F32)
                      for v in gguf.quants.Q4_K.get_scale_min(sb[..., 4:16].reshape(-1, 12)))
            d = fp16_up(d0 * sc).reshape(n, -1)
            m = fp16_up(-(dmin * mn)).reshape(n, -1)
            low = (sb[..., 48:].reshape(n, -1, 4, 1, 32) >> np.array([0, 4], np.uint8).reshape(1, 1, 1, 2, 1)) & 15
            high = (sb[..., 16:48].reshape(n, -1, 1, 32) >> np.arange(8, dtype=np.uint8).reshape(1, 1, 8, 1)) & 1
            q = low.reshape(n, -1, 8, 32).astype(np.int64) | high.astype(np.int64) << 4
        return kernels.Q4_1, (q.reshape(n, k), d.reshape(n, -1), m.reshape(n, -1))
    if fmt == kernels.Q5_0:
        blocks = data.reshape(n, k // 32, 22)
        q = gguf.quants.dequantize(data, T.Q5_0).reshape(n, k // 32, 32) / blocks[..., :2].copy().view(np.float16)
        return kernels.Q8_0, np.concatenate([blocks[..., :2], np.rint(q).astype(np.int8).view(np.uint8)], -1)
    sb = data.reshape(n, k // 256, 144)
    d, dmin = sb[..., 0:2].copy().view(np.float16).astype(F32), sb[..., 2:4].copy().view(np.float16).astype(F32)
    sc, m = gguf.quants.Q4_K.get_scale_min(sb[..., 4:16].reshape(-1, 12))
    sc, m = sc.reshape(n, -1, 8).astype(F32), m.reshape(n, -1, 8).astype(F32)
    qs = sb[..., 16:].reshape(n, -1, 4, 1, 32) >> np.array([0, 4], np.uint8).reshape(1, 1, 1, 2, 1) & 15
    q = qs.reshape(n, k).astype(np.int64)
    return kernels.Q4_K, (q, (d * sc).astype(F32).reshape(n, -1), (-(dmin * m)).astype(F32).reshape(n, -1))


def q8_linear(fmt: int, x: np.ndarray, data: np.ndarray, n: int, bias=None, out=None) -> np.ndarray:
    """The q8 linear of x [R, K] against n rows of format `fmt` (the file's bytes), as rows.cpp runs it (+ out)."""
    x = np.asarray(x, F32)
    k = x.shape[1]
    data = np.ascontiguousarray(data, np.uint8).reshape(n, -1)
    if fmt in BLOCK:
        y = q8_reference(fmt, x, data, n, k, bias)
    else:
        lay, blocks = as_q8_layout(fmt, data, n, k)
        if lay in (kernels.Q6_K, kernels.Q3_K, kernels.Q2_K):
            y = halves_reference(x, *blocks, up=lay != kernels.Q6_K)
        elif fmt in (kernels.Q5_1, kernels.Q5_K, kernels.Q4_K):
            y = q8_reference(lay, x, None, n, k, weights=blocks)
        else:
            y = q8_reference(lay, x, np.ascontiguousarray(blocks).reshape(n, -1), n, k)
        if bias is not None:
            y = (y + np.asarray(bias, F32)[None]).astype(F32)
    return y if out is None else out + y
