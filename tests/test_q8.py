"""The q8 numerics mode: int8 activations against Q4_0/Q4_1/Q8_0 weight blocks. The kernel against a numpy
rebuild of the same integer and fp32 arithmetic (bitwise), the AVX2 build against the AVX-512 VNNI build, whole
passes row-invariant, and speculation token-identical to q8 target-only."""
import gguf
import numpy as np
import pytest
import torch
from test_runtime import assert_speculation_equals_target_only, gguf_pair  # noqa: F401 - gguf_pair: a fixture

from specdec import kernels
from specdec.kernels.reference.q8 import q8_linear, q8_reference
from specdec.kernels.reference.simd import fma32
from specdec.runtime.load import load_gguf

T = gguf.GGMLQuantizationType
needs_kernel = pytest.mark.skipif(not kernels.available(), reason="no AVX2/AVX-512 CPU or no C++ compiler")
F32 = np.float32
K_TYPES = {kernels.Q2_K, kernels.Q3_K, kernels.Q4_K, kernels.Q5_K, kernels.Q6_K}


def test_fma32_rounds_once():
    one, eps = F32(1), F32(2.0 ** -23)
    # (1 + 2^-23)(1 - 2^-23) = 1 - 2^-46: a multiply then an add (of 0) rounds to 1; fused, the same here
    assert fma32(one + eps, one - eps, F32(-1)) == F32(-(2.0 ** -46))  # the product's low bits survive the add
    # s lands exactly on a midpoint after rounding to float64 while the exact sum lies just above it
    a, b, c = F32(1 + 2.0 ** -12), F32(1 + 2.0 ** -12), F32(2.0 ** -60)
    exact = (1 + 2.0 ** -12) ** 2  # 1 + 2^-11 + 2^-24: a tie for fp32 without c
    assert fma32(a, b, F32(0)) == np.float32(exact)  # ties to even: 1 + 2^-11
    assert fma32(a, b, c) == np.nextafter(np.float32(exact), F32(2))  # c breaks the tie upward








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








@needs_kernel
@pytest.mark.parametrize("fmt", [kernels.Q5_0, kernels.Q5_1, kernels.Q2_K, kernels.Q3_K, kernels.Q4_K, kernels.Q5_K,
                                 kernels.Q6_K], ids=lambda f: kernels.FORMATS[f])
def test_q8_runs_k_quants_and_5_bit_blocks_as_the_blocks_they_equal(fmt):
    """Q5_0 in q8 is bitwise the Q8_0 q8 linear on the same weights; Q4_K is the Q4_1 q8 linear on its sub-blocks with
    fp32 scales (exact products d·sc, -dmin·m), and Q5_1 / Q5_K the same sums on byte quants with fp16 ones; Q6_K, Q3_K and Q2_K sum each 16-column half exactly
    and scale it by its d·sc (Q6_K fp32, exact; the others fp16), Q2_K adding its fp16 min times the half's Σx (numpy references), for 1..29 rows;
    scales are stored times 2^8, so sub-block scales below fp16's normal numbers (down to 2^-22) still run q8, bitwise
    the reference; a tensor whose scales even that cannot hold runs exact instead."""
    from specdec.runtime.quantize import quantize
    from specdec.runtime.weights import QTensor, qlinear
    n, k = 37, 512
    w = np.random.default_rng(fmt).standard_normal((n, k)).astype(F32)
    data = quantize(w, fmt)
    x = np.random.default_rng(2).standard_normal((29, k)).astype(F32)
    x[4, 64:96] = 0
    want = q8_linear(fmt, x, data, n)  # reference/q8.py: the file's blocks rebuilt as the layout they run as
    for rows in (1, 2, 3, 4, 5, 8, 13, 29):
        got = kernels.linear(fmt, torch.from_numpy(x[:rows]), torch.from_numpy(data), n, q8=True)
        assert np.array_equal(got.numpy(), want[:rows]), rows
    if fmt in (kernels.Q2_K, kernels.Q3_K, kernels.Q4_K, kernels.Q5_K, kernels.Q6_K):
        xt = torch.from_numpy(x)
        small = quantize(w * 1e-4, fmt)  # sub-block scales ~3e-5: below fp16's normal numbers (2^-14)
        qt = QTensor(fmt, torch.from_numpy(small), n, k)
        assert qt.packed() is not None
        assert np.array_equal(qlinear(xt, qt, q8=True).numpy(), q8_linear(fmt, x, small, n))
        huge = small.copy()  # one super-block's d at 1000: its d·sc (times 2^8) pass fp16's largest number
        size, (d_at, *_) = FP16_FIELDS[fmt]
        huge.reshape(n, -1, size)[0, 0, d_at:d_at + 2] = np.array([1000], np.float16).view(np.uint8)
        qt = QTensor(fmt, torch.from_numpy(huge), n, k)
        if fmt in (kernels.Q4_K, kernels.Q6_K):  # its own bytes, scales computed in fp32: any block runs q8
            assert np.array_equal(qlinear(xt, qt, q8=True).numpy(), q8_linear(fmt, x, huge, n))
        else:
            assert qt.packed() is None and torch.equal(qlinear(xt, qt, q8=True), qlinear(xt, qt))


@needs_kernel
@pytest.mark.parametrize("fmt", [kernels.Q4_0, kernels.Q4_1, kernels.Q8_0, kernels.Q5_0, kernels.Q2_K, kernels.Q3_K,
                                 kernels.Q4_K, kernels.Q5_K, kernels.Q6_K], ids=lambda f: kernels.FORMATS[f])
def test_every_tiling_gives_the_same_bits(fmt):
    """Passes of 9+ rows run in wide VNNI tiles of 9..16 rows (17+ in even tiles, 24 = 12 + 12, 17 = 9 + 8), in AMX
    tiles where asked, or in 8-row tiles: the same exact integer sums scaled in the same order, so the same bits as
    each other and as the numpy reference, whatever the rows and their tiling."""
    from specdec.runtime.quantize import quantize
    lib = kernels.library()
    arms = lib.tilings()
    if lib.isa == "avx512":
        assert "wide" in arms  # every AVX-512 VNNI build has wide tiles
    n, k = 37, 512  # two super-blocks: an AMX chunk of 8 blocks and the next; 3 groups, the last partial
    w = np.random.default_rng(fmt).standard_normal((n, k)).astype(F32)
    data = quantize(w, fmt) if fmt in K_TYPES else np.ascontiguousarray(
        gguf.quants.quantize(w, T(fmt)))
    x = np.random.default_rng(3).standard_normal((41, k)).astype(F32)
    x[10, 96:128] = 0  # an all-zero block inside a tile
    want = q8_linear(fmt, x, data, n)
    xt, wt = torch.from_numpy(x), torch.from_numpy(data)
    try:
        for rows in (8, 9, 10, 12, 15, 16, 17, 24, 41):
            for arm, (amx, wide) in arms.items():
                lib.rows_amx(amx), lib.rows_wide(wide)
                got = kernels.linear(fmt, xt[:rows], wt, n, lib=lib, q8=True).numpy()
                assert np.array_equal(got, want[:rows]), (rows, arm)
    finally:
        lib.rows_amx(lib.amx_rows), lib.rows_wide(lib.wide)


@needs_kernel
def test_every_tiling_keeps_whole_passes_row_invariant(q8_model):
    """Passes of 8..40 rows in each tiling equal one-token steps, bitwise."""
    lib, model = kernels.library(), q8_model
    ids = torch.randint(3, 90, (40,), generator=torch.Generator().manual_seed(1)).tolist()
    a, b = model.acquire_slot(), model.acquire_slot()
    steps = torch.cat([model.forward([t], [b], [i]) for i, t in enumerate(ids)])
    try:
        for n in (8, 9, 13, 16, 25, 40):
            for arm, (amx, wide) in lib.tilings().items():
                lib.rows_amx(amx), lib.rows_wide(wide)
                assert torch.equal(model.forward(ids[:n], [a] * n, list(range(n))), steps[:n]), (n, arm)
    finally:
        lib.rows_amx(lib.amx_rows), lib.rows_wide(lib.wide)
        model.release_slot(a), model.release_slot(b)


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


@needs_kernel
@pytest.mark.parametrize("fmt", [kernels.Q4_0, kernels.Q8_0, kernels.Q5_0, kernels.Q4_K, kernels.Q6_K],
                         ids=lambda f: kernels.FORMATS[f])
def test_prefetch_distances_change_no_bit(fmt):
    """How far q8 tiles prefetch is chosen per CPU (rows_prefetch3): any distance, one-row and multi-row tiles, with
    or without the second prefetch into L2, gives the numpy reference's bits; the distances are clamped to multiples
    of 64 up to 64 KB."""
    from specdec.runtime.quantize import quantize
    lib = kernels.library()
    n, k = 37, 512
    w = np.random.default_rng(fmt).standard_normal((n, k)).astype(F32)
    data = quantize(w, fmt) if fmt in K_TYPES else np.ascontiguousarray(gguf.quants.quantize(w, T(fmt)))
    x = np.random.default_rng(4).standard_normal((9, k)).astype(F32)
    want = q8_linear(fmt, x, data, n)
    xt, wt = torch.from_numpy(x), torch.from_numpy(data)
    before = lib.prefetch
    try:
        for one, many, l2, force in ((0, 0, 0, (0, 0, 0)), (100, 70000, 70000, (64, 65536, 65536)),
                                     (8192, 2048, 16384, (8192, 2048, 16384)), (2048, 8192, 130, (2048, 8192, 128))):
            assert lib.set_prefetch(one, many, l2) == force
            for rows in (1, 2, 4, 8, 9):
                assert np.array_equal(kernels.linear(fmt, xt[:rows], wt, n, lib=lib, q8=True).numpy(), want[:rows])
        assert lib.set_prefetch(-1, 4096) == (2048, 4096, 128)  # -1 keeps a distance
    finally:
        lib.set_prefetch(*before)


def test_tiling_switches_read_0_or_1_and_say_so_of_anything_else(monkeypatch, capsys):
    """SPECDEC_WIDE (default on) and SPECDEC_AMX (default off): 0 or 1; another value is one stderr line naming it,
    and the default."""
    for name, default in (("SPECDEC_WIDE", True), ("SPECDEC_AMX", False)):
        monkeypatch.delenv(name, raising=False)
        assert kernels.env_switch(name, default) is default and not capsys.readouterr().err
        for value, want in (("0", False), ("1", True), (" 1 ", True)):
            monkeypatch.setenv(name, value)
            assert kernels.env_switch(name, default) is want
        for bad in ("yes", "2", "off"):
            monkeypatch.setenv(name, bad)
            assert kernels.env_switch(name, default) is default
            err = capsys.readouterr().err
            assert err.count("\n") == 1 and name in err and repr(bad) in err


def test_prefetch_distances_by_cpu_and_override(monkeypatch, capsys):
    """The distances come from the CPU's vendor; SPECDEC_Q8_AHEAD=ONE[,MANY[,L2]] overrides them; a malformed value
    is one stderr line and the CPU's distances."""
    monkeypatch.setattr(kernels, "cpuinfo", lambda field: {"vendor_id": "AuthenticAMD"}.get(field, ""))
    monkeypatch.delenv("SPECDEC_Q8_AHEAD", raising=False)
    assert kernels.prefetch_distances() == kernels.PREFETCH["AuthenticAMD"]
    monkeypatch.setattr(kernels, "cpuinfo", lambda field: "")
    assert kernels.prefetch_distances() == kernels.PREFETCH_OTHER
    monkeypatch.setenv("SPECDEC_Q8_AHEAD", "6144")
    assert kernels.prefetch_distances() == (6144, 6144, 0)
    monkeypatch.setenv("SPECDEC_Q8_AHEAD", "1024,8192")
    assert kernels.prefetch_distances() == (1024, 8192, 0)
    monkeypatch.setenv("SPECDEC_Q8_AHEAD", "1024,8192,32768")
    assert kernels.prefetch_distances() == (1024, 8192, 32768)
    for bad in ("fast", "1,2,3,4", "-64", "99999999", "64,64,70000"):
        monkeypatch.setenv("SPECDEC_Q8_AHEAD", bad)
        assert kernels.prefetch_distances() == kernels.PREFETCH_OTHER
        assert "SPECDEC_Q8_AHEAD" in capsys.readouterr().err


def test_a_build_from_before_the_l2_distance_is_called_with_its_own_two(tmp_path):
    """benchmarks/runtime.py same-kernels loads older builds, whose rows_prefetch takes (one, many, out): _prefetch calls
    it with two distances (the L2 one reported as 0), never three (its third argument is the output pointer)."""
    import ctypes
    import shutil
    import subprocess
    cxx = shutil.which("g++") or shutil.which("c++")
    if cxx is None:
        pytest.skip("no C++ compiler")
    src = tmp_path / "old.cpp"
    src.write_text('static int a = 1, b = 2;\nextern "C" void rows_prefetch(int one, int many, int* out) '
                   '{ if (one >= 0) a = one; if (many >= 0) b = many; out[0] = a, out[1] = b; }\n')
    so = tmp_path / "old.so"
    subprocess.run([cxx, "-shared", "-fPIC", str(src), "-o", str(so)], check=True)
    call = kernels._prefetch(ctypes.CDLL(str(so)))
    assert call(4096, 8192, 16384) == (4096, 8192, 0)
    assert call(-1, 64, -1) == (4096, 64, 0)
    none = tmp_path / "none.cpp"
    none.write_text('extern "C" int nothing() { return 0; }\n')
    subprocess.run([cxx, "-shared", "-fPIC", str(none), "-o", str(tmp_path / "none.so")], check=True)
    assert kernels._prefetch(ctypes.CDLL(str(tmp_path / "none.so")))(1, 2, 3) is None


@needs_kernel
@pytest.mark.parametrize("numerics", ["q8", "exact"])
def test_passes_are_the_same_bits_on_any_thread_count(numerics):
    """The kernels split a pass's work over torch's threads (`--threads`); each output is computed by one thread
    the same way whatever the split, so passes of the default model are bitwise the same on 1, 2, 3 or 5 threads."""
    from specdec import models
    model, _ = models.load("default", numerics=numerics)
    ids = torch.randint(3, 40000, (24,), generator=torch.Generator().manual_seed(3)).tolist()
    before, seen = torch.get_num_threads(), []
    try:
        for threads in (1, 2, 3, 5):
            torch.set_num_threads(threads)
            slot = model.acquire_slot()
            prefill = model.forward(ids[:16], [slot] * 16, list(range(16)))
            verify = model.forward(ids[16:], [slot] * 8, list(range(16, 24)))  # a verify pass of 8 rows
            step = model.forward(ids[16:17], [slot], [16])
            model.release_slot(slot)
            seen.append((prefill, verify, step))
    finally:
        torch.set_num_threads(before)
    for got in seen[1:]:
        assert all(torch.equal(a, b) for a, b in zip(seen[0], got))
    assert torch.equal(seen[0][2], seen[0][1][:1])
