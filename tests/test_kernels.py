"""specdec's CPU kernel on fp32 weights (the transformers backend's linears): same result as F.linear, refuses what it
cannot do, can be turned off. Quantized formats and the runtime: test_runtime.py."""
import pytest
import torch
from torch.nn import functional as F

from specdec import kernels
from specdec.kv import KERNEL_ROWS, rows_linear

needs_kernel = pytest.mark.skipif(not kernels.available(), reason="no AVX2/AVX-512 CPU or no C++ compiler")


@needs_kernel
@pytest.mark.parametrize("k", [16, 37, 576])  # 37: a tail of K % 16 columns
@pytest.mark.parametrize("bias", [False, True])
def test_kernel_equals_linear_for_every_row_count(k, bias):
    torch.manual_seed(k)
    w, b = torch.randn(67, k), (torch.randn(67) if bias else None)
    for rows in range(1, kernels.MAX_ROWS + 1):
        for shape in ((rows, k), (1, rows, k)):
            x = torch.randn(*shape)
            y = kernels.few_rows_linear(x, w, b)
            assert y.shape == (*shape[:-1], 67)
            assert torch.allclose(y, F.linear(x, w, b), rtol=1e-5, atol=1e-6 * k)  # fp32 sums of k terms


@needs_kernel
def test_kernel_row_results_do_not_depend_on_the_rows_around_them():
    """A verify pass over n tokens computes each token's row exactly as a one-token decode step would."""
    torch.manual_seed(0)
    w, x = torch.randn(96, 576), torch.randn(8, 576)
    alone = torch.cat([kernels.few_rows_linear(x[i:i + 1], w) for i in range(8)])
    for rows in range(2, 9):
        assert torch.equal(kernels.few_rows_linear(x[:rows], w), alone[:rows])


@needs_kernel
def test_kernel_declines_what_it_cannot_do_and_rows_linear_falls_back():
    w = torch.randn(8, 32)
    assert kernels.few_rows_linear(torch.randn(kernels.MAX_ROWS + 1, 32), w) is None  # too many rows
    assert kernels.few_rows_linear(torch.randn(2, 32, dtype=torch.float64), w.double()) is None
    assert kernels.few_rows_linear(torch.randn(2, 31), w) is None  # shape mismatch: never reads out of bounds
    assert kernels.few_rows_linear(torch.randn(2, 32), w.t().contiguous().t()) is None  # non-contiguous weight
    with pytest.raises(RuntimeError):
        rows_linear(torch.randn(2, 31), w)  # the mismatch gets torch's own error
    x = torch.randn(KERNEL_ROWS, 32, requires_grad=True)
    rows_linear(x, w).sum().backward()  # autograd takes torch's differentiable path
    assert torch.allclose(x.grad, w.sum(0).expand(KERNEL_ROWS, 32))


def test_kernel_can_be_turned_off(monkeypatch):
    monkeypatch.setenv("SPECDEC_CPU_KERNEL", "0")
    kernels.library.cache_clear()
    try:
        assert not kernels.available() and kernels.few_rows_linear(torch.randn(1, 16), torch.randn(4, 16)) is None
        x, w = torch.randn(3, 16), torch.randn(4, 16)
        assert torch.allclose(rows_linear(x, w), F.linear(x, w), atol=1e-6)  # torch's paths serve instead
    finally:
        kernels.library.cache_clear()


def test_a_failed_build_falls_back_with_one_line(monkeypatch, tmp_path, capsys):
    """A compiler that fails (or a cache that cannot be written) costs one stderr line, not a crash."""
    if kernels.best_isa() is None:
        pytest.skip("the build is only attempted on AVX2/AVX-512 CPUs")
    broken = tmp_path / "broken-cxx"
    broken.write_text("#!/bin/sh\necho 'error: this compiler is broken' >&2\nexit 1\n")
    broken.chmod(0o755)
    monkeypatch.setenv("CXX", str(broken))
    monkeypatch.setenv("SPECDEC_CACHE", str(tmp_path / "cache"))
    kernels.library.cache_clear()
    try:
        assert not kernels.available()
        x, w = torch.randn(3, 16), torch.randn(4, 16)
        assert torch.allclose(rows_linear(x, w), F.linear(x, w), atol=1e-6)
        said = capsys.readouterr().err.strip().splitlines()
        assert said[0].startswith("specdec: compiling the") and len(said) == 2  # the build's progress line, then
        err = said[1]  # the failure's one line
        assert "CPU kernel unavailable" in err and "this compiler is broken" in err
    finally:
        kernels.library.cache_clear()


@needs_kernel
def test_argmax_kernel_equals_torch_on_both_builds_ties_tails_and_non_finite_rows():
    g = torch.Generator().manual_seed(5)
    for vocab in (1, 15, 16, 17, 49152 + 7):
        x = torch.randn(9, vocab, generator=g) * 5
        x[1, vocab // 3] = x[1, vocab - 1] = 100.0  # a tie: the first index wins, as torch's
        x[2] = -3.0  # all equal
        x[3, vocab // 2] = float("nan")
        x[4, 0] = float("-inf")
        x[5] = float("-inf")
        x[6, vocab - 1] = float("inf")
        for isa in {kernels.library().isa, "avx2"}:
            assert kernels.argmax(x, kernels.library(isa)) == x.argmax(-1).tolist(), (vocab, isa)
    assert kernels.argmax(x.double()) == x.double().argmax(-1).tolist()  # other dtypes: torch's
