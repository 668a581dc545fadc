"""simd.h's arithmetic in numpy fp32: a fused multiply-add rounded once, the fixed 16-lane sum tree, and exp."""
from __future__ import annotations

import numpy as np

F32 = np.float32


def fma32(a, b, c) -> np.ndarray:
    """fp32 fused multiply-add, rounded once: a·b is exact in float64, TwoSum gives s + lo == a·b + c exactly, and
    fp32(s) is the correctly rounded result unless s is exactly halfway between two fp32 values (float64 holds every
    fp32 midpoint, so rounding to float64 can land on one but never cross one): then lo's sign decides."""
    a, b, c = (np.asarray(v, F32).astype(np.float64) for v in (a, b, c))
    prod = a * b
    s = prod + c
    bv = s - prod
    with np.errstate(invalid="ignore"):
        lo = (prod - (s - bv)) + (c - bv)
    r = s.astype(F32)
    d = s - r.astype(np.float64)
    other = np.nextafter(r, np.where(d > 0, F32(np.inf), F32(-np.inf))).astype(F32)
    with np.errstate(invalid="ignore"):
        tie = (d != 0) & (2 * np.abs(d) == np.abs(other.astype(np.float64) - r.astype(np.float64))) & (lo != 0)
    up = np.where(lo > 0, np.maximum(r, other), np.minimum(r, other))
    return np.where(tie, up, r).astype(F32)


def vsum(lanes: np.ndarray) -> np.ndarray:
    """The 16 lanes of the last axis summed in simd.h's tree: 8+8, 4+4, then (0+2) + (1+3)."""
    a = np.asarray(lanes, F32)
    s8 = a[..., 8:] + a[..., :8]
    s4 = s8[..., 4:] + s8[..., :4]
    return (s4[..., 0] + s4[..., 2]) + (s4[..., 1] + s4[..., 3])


_EXP_HI, _EXP_LO = F32(88.3762626647949), F32(-87.3365447504)
_POLY = [F32(c) for c in (1.3981999507e-3, 8.3334519073e-3, 4.1665795894e-2, 1.6666665459e-1, 5.0000001201e-1)]


def vexp(x0) -> np.ndarray:
    """simd.h's vexp: Cephes' expf (x = n ln2 + r, a degree-6 polynomial in r, times 2^n), exactly 0 below -87.34."""
    x0 = np.asarray(x0, F32)
    x = np.maximum(np.minimum(x0, _EXP_HI), _EXP_LO)
    n = np.floor(fma32(x, F32(1.44269504088896341), F32(0.5))).astype(F32)
    r = (x - n * F32(0.693359375)) - n * F32(-2.12194440e-4)
    y = np.full_like(r, F32(1.9875691500e-4))
    for c in _POLY:
        y = fma32(y, r, c)
    y = fma32(y, r * r, r) + F32(1)
    out = (y * np.ldexp(F32(1), n.astype(np.int32)).astype(F32)).astype(F32)
    return np.where(x0 < _EXP_LO, F32(0), out).astype(F32)


def silu(g) -> np.ndarray:
    g = np.asarray(g, F32)
    return g / (F32(1) + vexp(F32(0) - g))


def gelu(g) -> np.ndarray:
    """torch's gelu(approximate="tanh") as simd's lanes compute it: tanh(u) = 1 - 2 / (1 + exp(2u))."""
    g = np.asarray(g, F32)
    u = F32(0.7978845608028654) * (g + F32(0.044715) * (g * (g * g)))
    t = F32(1) - F32(2) / (F32(1) + vexp(u + u))
    return (F32(0.5) * g) * (F32(1) + t)
