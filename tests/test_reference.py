"""Every kernel against its reference twin (specdec/kernels/reference/, one module per header), bitwise, on both
builds: the exact linear on every format, RMSNorm, whole passes (rotary, paged attention with sliding windows and
tree paths, the gated MLP, post-norms, q/k norms; exact and q8) on tiny models of each architecture, top-k with its
log-sum-exp, argmax and the race. The q8 linear on every format: test_q8.py."""
from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch
from test_architectures import arch_pair  # noqa: F401 - a fixture
from test_runtime import gguf_pair  # noqa: F401 - a fixture

from specdec import kernels
from specdec.kernels import formats
from specdec.kernels.reference import attention, layer, linear, norms, q8, selection, simd
from specdec.runtime.load import load_gguf
from specdec.runtime.quantize import quantize

pytestmark = pytest.mark.skipif(not kernels.available(), reason="no AVX2/AVX-512 CPU or no C++ compiler")
F32 = np.float32


def builds():
    """The kernels of this machine's instruction set, and the AVX2 build beside an AVX-512 one."""
    return [kernels.library()] + ([kernels.library("avx2")] if kernels.library().isa != "avx2" else [])


def blocks_of(fmt: int, n: int, k: int, seed: int) -> np.ndarray:
    w = np.random.default_rng(seed).standard_normal((n, k)).astype(F32)
    if fmt == formats.F32:
        return w.view(np.uint8).reshape(n, -1)
    if fmt == formats.F16:
        return w.astype(np.float16).view(np.uint8).reshape(n, -1)
    if fmt == formats.BF16:
        return (w.view(np.uint32) >> 16).astype(np.uint16).view(np.uint8).reshape(n, -1)
    if fmt in (formats.Q4_0, formats.Q4_1, formats.Q8_0, formats.Q5_0, formats.Q5_1):
        return np.ascontiguousarray(gguf.quants.quantize(w, gguf.GGMLQuantizationType(fmt))).reshape(n, -1)
    return quantize(w, fmt).reshape(n, -1)


def test_simd_helpers_are_what_they_claim():
    lanes = np.arange(16, dtype=F32) * F32(0.1)
    tree = ((lanes[0] + lanes[8]) + (lanes[4] + lanes[12])) + ((lanes[2] + lanes[10]) + (lanes[6] + lanes[14]))
    tree = tree + (((lanes[1] + lanes[9]) + (lanes[5] + lanes[13])) + ((lanes[3] + lanes[11]) + (lanes[7] + lanes[15])))
    assert simd.vsum(lanes) == tree
    x = np.linspace(-100, 90, 2001).astype(F32)
    e = simd.vexp(x)
    assert np.all(e[x < F32(-87.3365447504)] == 0) and np.all(np.isfinite(e))
    inside = (x > -80) & (x < 80)
    assert np.allclose(e[inside], np.exp(x[inside].astype(np.float64)), rtol=3e-7)  # ~1 ulp, Cephes' expf


@pytest.mark.parametrize("fmt", [f.id for f in formats.TABLE], ids=lambda f: formats.NAMES[f])
def test_exact_linear_equals_its_twin_on_every_format(fmt):
    """linear.h (in registers up to 11 rows, through the L1 buffer from 12) against reference/linear.py."""
    f = formats.of(fmt)
    k = 256 if f.block == 256 else (37 if f.is_float else 96)  # 37: a tail of K % 16 columns
    n = 21
    data = blocks_of(fmt, n, k, seed=fmt)
    bias = np.random.default_rng(1).standard_normal(n).astype(F32)
    x = np.random.default_rng(2).standard_normal((13, k)).astype(F32)
    want = linear.linear_blocks(fmt, x, data, n, bias)
    for lib in builds():
        for rows in (1, 2, 5, 8, 12, 13):
            got = kernels.linear(fmt, torch.from_numpy(x[:rows]), torch.from_numpy(np.ascontiguousarray(data)), n,
                                 torch.from_numpy(bias), lib=lib)
            assert np.array_equal(got.numpy(), want[:rows]), (lib.isa, rows)


@pytest.mark.parametrize("fmt", [f.id for f in formats.TABLE], ids=lambda f: formats.NAMES[f])
def test_dequantized_rows_equal_their_twin_on_every_format(fmt):
    """rows_dequantize (embedding lookups, QTensor.rows) against reference/formats.py (gguf's dequantization), both
    builds, bitwise: rows in any order, repeated, none; an id outside the rows is an error, never a read."""
    from specdec.kernels.reference.formats import dequantize
    from specdec.runtime.weights import QTensor
    f = formats.of(fmt)
    k = 256 if f.block == 256 else (37 if f.is_float else 96)
    n = 21
    data = np.ascontiguousarray(blocks_of(fmt, n, k, seed=fmt))
    want = dequantize(fmt, data, n, k)
    w = torch.from_numpy(data)
    for lib in builds():
        for idx in ([0], [20, 3, 3, 7], list(range(n)), []):
            got = kernels.dequantize_rows(fmt, w, n, k, torch.tensor(idx, dtype=torch.long), lib=lib)
            assert got.shape == (len(idx), k) and np.array_equal(got.numpy(), want[idx]), (lib.isa, idx)
        for bad in ([n], [-1]):
            with pytest.raises(ValueError):
                kernels.dequantize_rows(fmt, w, n, k, torch.tensor(bad), lib=lib)
    assert np.array_equal(QTensor(fmt, w, n, k).rows([5, 1]).numpy(), want[[5, 1]])


@pytest.mark.parametrize("fmt", [f.id for f in formats.TABLE if f.q8], ids=lambda f: formats.NAMES[f])
def test_q8_linear_equals_its_twin_on_every_format(fmt):
    """q8_linear.h (tiles of 1..8 rows on AVX-512, of 9..16 by AMX where the CPU has it, 1..4 on AVX2; a 16-row
    group with padding rows) against reference/q8.py, both builds: the same bits whichever instructions sum the
    blocks."""
    k = 512 if formats.of(fmt).block == 256 else 96
    n = 21
    data = blocks_of(fmt, n, k, seed=fmt)
    bias = np.random.default_rng(1).standard_normal(n).astype(F32)
    x = np.random.default_rng(2).standard_normal((13, k)).astype(F32)
    x[3, 32:64] = 0  # an all-zero block: s = 0
    want = q8.q8_linear(fmt, x, data, n, bias)
    for lib in builds():
        kernels.repack(fmt, torch.from_numpy(np.ascontiguousarray(data)), n, k, lib)  # NotRepackable: not q8 at all
        for rows in (1, 2, 5, 8, 9, 13):
            got = kernels.linear(fmt, torch.from_numpy(x[:rows]), torch.from_numpy(np.ascontiguousarray(data)), n,
                                 torch.from_numpy(bias), lib=lib, q8=True)
            assert np.array_equal(got.numpy(), want[:rows]), (lib.isa, rows)
        for r in range(13):  # row-invariance, directly: row r of the 13-row pass is the one-row pass of x[r]
            alone = kernels.linear(fmt, torch.from_numpy(x[r:r + 1]), torch.from_numpy(np.ascontiguousarray(data)),
                                   n, torch.from_numpy(bias), lib=lib, q8=True)
            assert np.array_equal(alone.numpy()[0], got.numpy()[r]), (lib.isa, r)


@pytest.mark.parametrize("d", [16, 37, 64, 576])
def test_rmsnorm_equals_its_twin(d):
    x = np.random.default_rng(d).standard_normal((5, d)).astype(F32) * 3
    w = np.random.default_rng(1).standard_normal(d).astype(F32)
    want = norms.rmsnorm(x, w, 1e-5)
    for lib in builds():
        got = kernels.rmsnorm(torch.from_numpy(x), torch.from_numpy(w), 1e-5, lib)
        assert np.array_equal(got.numpy(), want), lib.isa


def test_attention_twin_hides_the_window_and_matches_softmax():
    """The reference itself: a window's hidden keys weigh nothing, and the result is softmax(q·k)·v to ~1e-6."""
    rng = np.random.default_rng(0)
    q, keys, values = (rng.standard_normal(s).astype(F32) for s in ((2, 16), (40, 16), (40, 16)))
    for window in (0, 7, 30):
        got = attention.attend(q, keys, values, window)
        lo = 40 - window if window else 0
        s = (q.astype(np.float64) @ keys[lo:].T.astype(np.float64)) / 4.0
        p = np.exp(s - s.max(1, keepdims=True))
        want = (p / p.sum(1, keepdims=True)) @ values[lo:].astype(np.float64)
        assert np.allclose(got, want, atol=2e-6)


def _with_isa(model, lib):
    model._lib = lib
    return model


def _pass(model, tokens):
    s = model.acquire_slot()
    try:
        return model.forward(tokens, [s] * len(tokens), list(range(len(tokens))), hidden=True)
    finally:
        model.release_slot(s)


def assert_passes_equal_the_twin(model, tokens):
    for numerics in ("exact", "q8"):
        model.set_numerics(numerics)
        want_logits, want_hidden = layer.forward(model, tokens)
        for lib in builds():
            logits, hidden = _pass(_with_isa(model, lib), tokens)
            assert np.array_equal(hidden.numpy(), want_hidden), (numerics, lib.isa)
            assert np.array_equal(logits.numpy(), want_logits), (numerics, lib.isa)
    model._lib = kernels.library()


def test_llama_passes_equal_the_twin(gguf_pair):  # noqa: F811
    """Q4_0/Q4_1/Q8_0/F16/BF16 linears, llama.cpp's interleaved rotary rows, 4 heads on 2 KV heads, 35 rows (two
    whole blocks of 16 keys and a tail)."""
    tokens = [int(t) for t in np.random.default_rng(0).integers(3, 99, 35)]
    assert_passes_equal_the_twin(load_gguf(gguf_pair[0]), tokens)


def test_each_architecture_equals_the_twin(arch_pair):  # noqa: F811
    """Qwen3 (q/k norms), Gemma 3 (sliding windows of 7 with 16-aligned starts past the first block, post-norms,
    GeGLU, embedding scale, its own attention scale and local rotary bases), Phi-3 (fused matrices, a window),
    Llama 3.1 (scaled rotary); K-quant and 5-bit linears."""
    arch, _, d = arch_pair
    tokens = [int(t) for t in np.random.default_rng(1).integers(3, 99, 26)]
    assert_passes_equal_the_twin(load_gguf(d / "tiny.gguf"), tokens)


def test_tree_rows_equal_the_twin_of_their_paths(gguf_pair):  # noqa: F811
    """A tree pass's node = the reference's one pass over the prefix and the node's path."""
    model = load_gguf(gguf_pair[0])
    prefix = [int(t) for t in np.random.default_rng(2).integers(3, 99, 19)]
    tree, parents = [21, 22, 23, 24, 25, 26], [-1, 0, 0, 1, 3, -1]
    for numerics in ("exact", "q8"):
        model.set_numerics(numerics)
        for lib in builds():
            cache = _with_isa(model, lib).new_cache()
            got = cache.forward_tree(prefix, tree, parents)
            cache.close()
            for i in range(len(tree)):
                path, at = [], i
                while at >= 0:
                    path.insert(0, tree[at])
                    at = parents[at]
                want, _ = layer.forward(model, prefix + path)
                assert np.array_equal(got[1 + i].numpy(), want[-1]), (numerics, lib.isa, i)
    model._lib = kernels.library()


def test_topk_argmax_and_race_equal_their_twins():
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(5, 1000 + 37, generator=g) * 4  # a tail past the 64-wide blocks and the 16 lanes
    logits[1, 500] = 80.0
    logits[2, 10] = logits[2, 900] = 50.0  # a tie: the lower index first
    want_idx, want_val, want_lse = selection.topk(logits.numpy(), 8)
    x = logits.clone()
    x[3, 7] = float("nan")
    for lib in builds():
        idx, val, lse = torch.empty(5, 8, dtype=torch.int32), torch.empty(5, 8), torch.empty(5)
        lib.rows_topk(logits.data_ptr(), 5, logits.shape[1], 8, idx.data_ptr(), val.data_ptr(), lse.data_ptr(), 2)
        assert np.array_equal(idx.numpy(), want_idx) and np.array_equal(val.numpy(), want_val)
        assert np.array_equal(lse.numpy(), want_lse), lib.isa
        assert kernels.argmax(x, lib) == selection.argmax(x.numpy()), lib.isa
    p = torch.softmax(torch.randn(4, 300, generator=g), -1).double()
    p[2, :150] = 0
    keys = [7, 2 ** 64 - 1, 12345678901234567, 0]
    for lib in builds():
        assert kernels.race(p, keys, lib) == selection.race(p.numpy(), keys), lib.isa
