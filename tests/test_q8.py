"""The q8 numerics mode: int8 activations against Q4_0/Q4_1/Q8_0 weight blocks. The kernel against a numpy
rebuild of the same integer and fp32 arithmetic (bitwise), the AVX2 build against the AVX-512 VNNI build, whole
passes row-invariant, and speculation token-identical to q8 target-only."""
import gguf
import numpy as np
import pytest
import torch

from specdec import kernels
from specdec.runtime.load import load_gguf
from test_runtime import assert_speculation_equals_target_only, gguf_pair  # noqa: F401 - gguf_pair: a fixture

T = gguf.GGMLQuantizationType
needs_kernel = pytest.mark.skipif(not kernels.available(), reason="no AVX2/AVX-512 CPU or no C++ compiler")
F32 = np.float32
BLOCK = {kernels.Q4_0: 18, kernels.Q4_1: 20, kernels.Q8_0: 34}
K_TYPES = {kernels.Q2_K, kernels.Q3_K, kernels.Q4_K, kernels.Q5_K, kernels.Q6_K}


def fma32(a, b, c) -> np.ndarray:
    """fp32 fused multiply-add, rounded once: a·b is exact in float64, TwoSum gives s + lo == a·b + c exactly, and
    fp32(s) is the correctly rounded result unless s is exactly halfway between two fp32 values (float64 holds every
    fp32 midpoint, so rounding to float64 can land on one but never cross one): then lo's sign decides."""
    a, b, c = (np.asarray(v, F32).astype(np.float64) for v in (a, b, c))
    prod = a * b
    s = prod + c
    bv = s - prod
    lo = (prod - (s - bv)) + (c - bv)
    r = s.astype(F32)
    d = s - r.astype(np.float64)
    other = np.nextafter(r, np.where(d > 0, F32(np.inf), F32(-np.inf))).astype(F32)
    tie = (d != 0) & (2 * np.abs(d) == np.abs(other.astype(np.float64) - r.astype(np.float64))) & (lo != 0)
    up = np.where(lo > 0, np.maximum(r, other), np.minimum(r, other))
    return np.where(tie, up, r).astype(F32)


def test_fma32_rounds_once():
    one, eps = F32(1), F32(2.0 ** -23)
    # (1 + 2^-23)(1 - 2^-23) = 1 - 2^-46: a multiply then an add (of 0) rounds to 1; fused, the same here
    assert fma32(one + eps, one - eps, F32(-1)) == F32(-(2.0 ** -46))  # the product's low bits survive the add
    # s lands exactly on a midpoint after rounding to float64 while the exact sum lies just above it
    a, b, c = F32(1 + 2.0 ** -12), F32(1 + 2.0 ** -12), F32(2.0 ** -60)
    exact = (1 + 2.0 ** -12) ** 2  # 1 + 2^-11 + 2^-24: a tie for fp32 without c
    assert fma32(a, b, F32(0)) == np.float32(exact)  # ties to even: 1 + 2^-11
    assert fma32(a, b, c) == np.nextafter(np.float32(exact), F32(2))  # c breaks the tie upward


def weights_of(fmt, data: np.ndarray, n: int, k: int):
    """Integer weights [n, k] (Q4_0 already minus 8), d [n, nb] and m [n, nb] (Q4_1) from the raw blocks."""
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
    return q, d, blocks[..., 2:4].copy().view(np.float16).astype(F32)[..., 0]


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
    return acc if bias is None else (acc + bias.astype(F32)[None]).astype(F32)


def quantized(fmt, n, k, seed):
    w = np.random.default_rng(seed).standard_normal((n, k)).astype(F32)
    data = gguf.quants.quantize(w, {kernels.Q4_0: T.Q4_0, kernels.Q4_1: T.Q4_1, kernels.Q8_0: T.Q8_0}[fmt])
    return np.ascontiguousarray(data)


@needs_kernel
@pytest.mark.parametrize("fmt", [kernels.Q4_0, kernels.Q4_1, kernels.Q8_0])
@pytest.mark.parametrize("k", [32, 96, 544])  # 1, 3 and 17 blocks
@pytest.mark.parametrize("n", [11, 37])  # not multiples of the 16-row groups: one partial group, two whole and one
def test_q8_kernel_equals_numpy_bitwise_on_every_isa(fmt, k, n):
    data = quantized(fmt, n, k, seed=k + fmt + n)
    bias = np.random.default_rng(1).standard_normal(n).astype(F32)
    x = np.random.default_rng(k).standard_normal((29, k)).astype(F32)
    x[3, :32] = 0  # an all-zero block: scale 0
    x[5, 7] = 1e4  # one large value: the rest of its block rounds to 0
    want = q8_reference(fmt, x, data, n, k, bias)
    libs = [kernels.library()] + ([kernels.library("avx2")] if kernels.library().isa != "avx2" else [])
    for lib in libs:
        for rows in (1, 2, 3, 4, 5, 8, 13, 29):
            got = kernels.linear(fmt, torch.from_numpy(x[:rows]), torch.from_numpy(data), n, torch.from_numpy(bias),
                                 lib=lib, q8=True)
            assert np.array_equal(got.numpy(), want[:rows]), (lib.isa, rows)
    packed = kernels.repack(fmt, torch.from_numpy(data), n, k)
    assert packed.numel() == -(-n // 16) * 16 * data.shape[1]  # the file's bytes, rows padded to 16


@needs_kernel
def test_q8_is_close_to_exact():
    data = quantized(kernels.Q4_1, 64, 576, seed=3)
    x = torch.randn(4, 576)
    w = torch.from_numpy(data)
    exact, q8 = kernels.linear(kernels.Q4_1, x, w, 64), kernels.linear(kernels.Q4_1, x, w, 64, q8=True)
    assert not torch.equal(exact, q8)  # a different arithmetic...
    assert (q8 - exact).abs().max() < 0.02 * exact.abs().max()  # ...close to the same numbers


@pytest.fixture(scope="module")
def q8_model(gguf_pair):  # noqa: F811
    model = load_gguf(gguf_pair[0])
    model.set_numerics("q8")
    return model


@needs_kernel
def test_q8_whole_pass_is_row_invariant(q8_model):
    """1..64 rows in one pass equal one-token steps bitwise, alone and with rows of other slots between them."""
    model = q8_model
    ids = torch.randint(3, 90, (64,), generator=torch.Generator().manual_seed(0)).tolist()
    a, b, c = model.acquire_slot(), model.acquire_slot(), model.acquire_slot()
    steps = torch.cat([model.forward([t], [b], [i]) for i, t in enumerate(ids)])
    for n in (1, 2, 7, 16, 64):
        assert torch.equal(model.forward(ids[:n], [a] * n, list(range(n))), steps[:n]), n
    model.forward(ids[:5], [c] * 5, list(range(5)))
    mixed = model.forward([ids[30], ids[5], ids[31]], [a, c, a], [30, 5, 31])
    assert torch.equal(mixed[[0, 2]], steps[30:32])
    exact = load_gguf(model.source)
    e = exact.forward(ids[:8], [exact.acquire_slot()] * 8, list(range(8)))
    assert not torch.equal(e, steps[:8]) and (e - steps[:8]).abs().max() < 0.1 * e.abs().max()
    for s in (a, b, c):
        model.release_slot(s)


@needs_kernel
def test_q8_speculation_is_token_identical_to_q8_target_only(q8_model, tok):
    assert_speculation_equals_target_only(q8_model, tok)


@needs_kernel
def test_q8_stores_kv_in_fp16_and_exact_in_fp32(gguf_pair):  # noqa: F811
    """q8 keeps K/V as fp16 (half the bytes attention reads), close to exact's fp32 ones; a pass over several rows still
    equals one-token steps bitwise; switching modes re-makes the slots in the mode's dtype."""
    model = load_gguf(gguf_pair[0])
    ids = [5, 9, 14, 3, 7]
    e = model.acquire_slot()
    model.forward(ids, [e] * 5, list(range(5)))
    exact_values = model.slot_kv(e, 5)[1].clone()
    model.set_numerics("q8")
    s, t = model.acquire_slot(), model.acquire_slot()
    assert model._kpool.dtype == model._vpool.dtype == torch.float16
    out = model.forward(ids, [s] * 5, list(range(5)))
    q8_values = model.slot_kv(s, 5)[1].float()
    assert (q8_values - exact_values).abs().max() < 0.05 * exact_values.abs().max()
    steps = torch.cat([model.forward([x], [t], [i]) for i, x in enumerate(ids)])
    assert torch.equal(steps, out)
    model.set_numerics("exact")
    model.forward(ids[:1], [s], [0])
    assert model._kpool.dtype == model._vpool.dtype == torch.float32


@needs_kernel
def test_repacking_drops_the_file_pages_and_the_file_bytes_stay_readable(gguf_pair):  # noqa: F811
    """q8 reads its repacked copy, so a GGUF tensor's file pages leave the resident set once repacked (madvise); the
    file's bytes read back unchanged, and in-memory tensors (which the call would zero) are never released."""
    from specdec.runtime.weights import QTensor
    model = load_gguf(gguf_pair[0])
    w = next(l.gate for l in model.layers if kernels.q8_format(l.gate.fmt))
    before = w.data.clone()  # (reads every page: resident now)
    assert w.mapped and not QTensor.from_float(torch.randn(4, 32)).mapped
    assert resident_pages(w.data) > 0
    w.packed()
    assert resident_pages(w.data) == 0
    assert torch.equal(w.data, before)


def resident_pages(t: torch.Tensor) -> int:
    """How many pages of t this process has mapped in (/proc/self/pagemap: bit 63 = present)."""
    import mmap
    import struct
    page = mmap.PAGESIZE
    start = t.data_ptr()
    first, last = start // page, -(-(start + t.numel() * t.element_size()) // page)
    with open("/proc/self/pagemap", "rb") as f:
        f.seek(first * 8)
        entries = f.read(8 * max(0, last - first))
    return sum(struct.unpack_from("<Q", entries, 8 * i)[0] >> 63 for i in range(len(entries) // 8))


def halves_reference(x: np.ndarray, q: np.ndarray, dsc: np.ndarray, mins=None) -> np.ndarray:
    """Q6_K's / Q3_K's / Q2_K's q8 linear in numpy: per 32-column block of x (quantized as for every format), each
    16-column half's exact integer dot product, then acc = fma(isum_a, d_a·s, acc), acc = fma(isum_b, d_b·s, acc),
    and for Q2_K acc = fma(m_a, s·Σx_a, acc), acc = fma(m_b, s·Σx_b, acc), in block order."""
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
    return acc


def as_q8_layout(fmt, data: np.ndarray, n: int, k: int) -> tuple[int, np.ndarray]:
    """The blocks the q8 mode runs a Q5_0 / Q4_K tensor as, rebuilt in numpy from the file's bytes: Q5_0 -> Q8_0
    (d, q - 16); Q4_K -> Q4_1 per 32-column sub-block (fp16 of d·sc and of -dmin·m, column i in byte i % 16)."""
    if fmt in (kernels.Q3_K, kernels.Q2_K):  # (q [n, k], fp16 d·sc per 16 columns[, fp16 -dmin·m])
        sbytes = 110 if fmt == kernels.Q3_K else 84
        sb = data.reshape(n, k // 256, sbytes)
        crumbs = lambda b: (b.reshape(n, -1, 2, 1, 32) >> np.array([0, 2, 4, 6], np.uint8).reshape(1, 1, 1, 4, 1)
                            ) & 3  # noqa: E731
        if fmt == kernels.Q3_K:
            hbit = (sb[..., :32].reshape(n, -1, 1, 32) >> np.arange(8, dtype=np.uint8).reshape(1, 1, 8, 1)) & 1
            q = crumbs(sb[..., 32:96]).reshape(n, -1, 256).astype(np.int64) - 4 + 4 * hbit.reshape(n, -1, 256)
            lo = (sb[..., 96:104].reshape(n, -1, 1, 8) >> np.array([0, 4], np.uint8).reshape(1, 1, 2, 1)) & 15
            hi = (sb[..., 104:108].reshape(n, -1, 1, 4) >> np.array([0, 2, 4, 6], np.uint8).reshape(1, 1, 4, 1)) & 3
            sc = (lo.reshape(n, -1, 16) | hi.reshape(n, -1, 16) << 4).astype(F32) - 32
            d = sb[..., 108:110].copy().view(np.float16).astype(F32)
            return kernels.Q3_K, (q.reshape(n, k), (d * sc).astype(np.float16).astype(F32), None)
        q = crumbs(sb[..., 16:80]).reshape(n, k).astype(np.int64)
        d, dmin = (sb[..., a:a + 2].copy().view(np.float16).astype(F32) for a in (80, 82))
        dsc = (d * (sb[..., :16] & 15).astype(F32)).astype(np.float16).astype(F32)
        mins = (-(dmin * (sb[..., :16] >> 4).astype(F32))).astype(np.float16).astype(F32)
        return kernels.Q2_K, (q, dsc, mins)
    if fmt == kernels.Q6_K:  # (fp16 d·sc of each 16 columns, q) -> reference arrays, not blocks
        blocks = data.reshape(n, k // 256, 210)
        d = blocks[..., 208:210].copy().view(np.float16).astype(F32)
        sc = blocks[..., 192:208].copy().view(np.int8).astype(F32)
        q = gguf.quants.dequantize(data, T.Q6_K).reshape(n, k // 256, 16, 16) / (d * sc)[..., None]
        return kernels.Q6_K, (np.rint(q).astype(np.int64).reshape(n, k), (d * sc).astype(np.float16).astype(F32), None)
    if fmt in (kernels.Q5_1, kernels.Q5_K):  # -> (q [n, k] in [0, 31], d, m per 32 columns): Q4_1's sums
        if fmt == kernels.Q5_1:
            blocks = data.reshape(n, k // 32, 24)
            d, m = (blocks[..., a:a + 2].copy().view(np.float16).astype(F32)[..., 0] for a in (0, 2))
            qh = blocks[..., 4:8].copy().view(np.uint32)
            low = np.concatenate([blocks[..., 8:] & 15, blocks[..., 8:] >> 4], -1).astype(np.int64)
            q = low | ((qh >> np.arange(32, dtype=np.uint32)) & 1).astype(np.int64) << 4
        else:
            sb = data.reshape(n, k // 256, 176)
            d0, dmin = sb[..., 0:2].copy().view(np.float16).astype(F32), sb[..., 2:4].copy().view(np.float16).astype(F32)
            sc, mn = (v.reshape(n, -1, 8).astype(F32) for v in gguf.quants.Q4_K.get_scale_min(sb[..., 4:16].reshape(-1, 12)))
            d = (d0 * sc).astype(np.float16).astype(F32).reshape(n, -1)
            m = (-(dmin * mn)).astype(np.float16).astype(F32).reshape(n, -1)
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
    q = qs.reshape(n, -1, 8, 32)
    dd = (d * sc).astype(np.float16).view(np.uint8).reshape(n, -1, 8, 2)
    mm = (-(dmin * m)).astype(np.float16).view(np.uint8).reshape(n, -1, 8, 2)
    return kernels.Q4_1, np.concatenate([dd, mm, q[..., :16] | q[..., 16:] << 4], -1).reshape(n, -1)


@needs_kernel
@pytest.mark.parametrize("fmt", [kernels.Q5_0, kernels.Q5_1, kernels.Q2_K, kernels.Q3_K, kernels.Q4_K, kernels.Q5_K,
                                 kernels.Q6_K], ids=lambda f: kernels.FORMATS[f])
def test_q8_runs_k_quants_and_5_bit_blocks_as_the_blocks_they_equal(fmt):
    """Q5_0 in q8 is bitwise the Q8_0 q8 linear on the same weights; Q4_K is the Q4_1 q8 linear on its sub-blocks with
    fp16 scales, and Q5_1 / Q5_K the same sums on byte quants; Q6_K, Q3_K and Q2_K sum each 16-column half exactly
    and scale it by its fp16 d·sc, Q2_K adding its fp16 min times the half's Σx (numpy references), for 1..29 rows;
    a tensor whose scales fp16 cannot hold runs exact instead."""
    from specdec.runtime.quantize import quantize
    from specdec.runtime.weights import QTensor, qlinear
    n, k = 37, 512
    w = np.random.default_rng(fmt).standard_normal((n, k)).astype(F32)
    data = quantize(w, fmt)
    lay, blocks = as_q8_layout(fmt, data, n, k)
    x = np.random.default_rng(2).standard_normal((29, k)).astype(F32)
    x[4, 64:96] = 0
    if lay in (kernels.Q6_K, kernels.Q3_K, kernels.Q2_K):
        want = halves_reference(x, *blocks)
    elif fmt in (kernels.Q5_1, kernels.Q5_K):
        want = q8_reference(lay, x, None, n, k, weights=blocks)
    else:
        want = q8_reference(lay, x, np.ascontiguousarray(blocks).reshape(n, -1), n, k)
    for rows in (1, 2, 3, 4, 5, 8, 13, 29):
        got = kernels.linear(fmt, torch.from_numpy(x[:rows]), torch.from_numpy(data), n, q8=True)
        assert np.array_equal(got.numpy(), want[:rows]), rows
    if fmt in (kernels.Q2_K, kernels.Q3_K, kernels.Q4_K, kernels.Q5_K, kernels.Q6_K):
        tiny = quantize(w * 1e-4, fmt)  # sub-block scales ~3e-5: below fp16's normal numbers
        qt = QTensor(fmt, torch.from_numpy(tiny), n, k)
        xt = torch.from_numpy(x)
        assert qt.packed() is None and torch.equal(qlinear(xt, qt, q8=True), qlinear(xt, qt))


# fp16 fields of each type's block: (block bytes, offsets of d / dmin / m), everything else may be any byte
FP16_FIELDS = {kernels.Q2_K: (84, (80, 82)), kernels.Q3_K: (110, (108,)), kernels.Q4_K: (144, (0, 2)),
               kernels.Q5_K: (176, (0, 2)), kernels.Q6_K: (210, (208,)), kernels.Q5_0: (22, (0,)),
               kernels.Q5_1: (24, (0, 2))}


@needs_kernel
@pytest.mark.parametrize("fmt", sorted(FP16_FIELDS), ids=lambda f: kernels.FORMATS[f])
def test_any_block_bytes_decode_as_gguf_does(fmt):
    """Random bytes in every quant and scale field (negative Q6_K / Q3_K sub-block scales, every 6-bit scale and min
    pattern, which our quantizer never writes), sane fp16 d: exact is bitwise the F32 linear on gguf's
    dequantization; q8 is row-invariant and close to exact."""
    from specdec.runtime.weights import QTensor, qlinear
    nbytes, fields = FP16_FIELDS[fmt]
    n, k = 37, 512
    rng = np.random.default_rng(fmt + 100)
    data = rng.integers(0, 256, (n, k // (256 if fmt in K_TYPES else 32), nbytes), dtype=np.uint8)
    for off in fields:
        data[..., off:off + 2] = rng.uniform(1e-3, 1e-2, data.shape[:2]).astype(np.float16)[..., None].view(np.uint8)
    data = np.ascontiguousarray(data.reshape(n, -1))
    ref = torch.from_numpy(gguf.quants.dequantize(data, T(fmt)).astype(F32).reshape(n, k))
    qt, dense = QTensor(fmt, torch.from_numpy(data), n, k), QTensor.from_float(ref)
    x = torch.randn(13, k)
    exact = qlinear(x, qt)
    assert torch.equal(exact, qlinear(x, dense))
    q8 = qlinear(x, qt, q8=True)
    assert qt.packed() is not None and not torch.equal(q8, exact)
    assert torch.equal(torch.cat([qlinear(x[i:i + 1], qt, q8=True) for i in range(13)]), q8)
    assert (q8 - exact).abs().max() < 0.03 * exact.abs().max()
