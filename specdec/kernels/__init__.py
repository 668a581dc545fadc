"""specdec's own CPU kernel for the linear layers of decode and verify passes (few_rows.cpp).

Built on first use with the system's C++ compiler (about a second) into $SPECDEC_CACHE/kernels and loaded with
ctypes; no build step at install time. Where it cannot serve — no AVX-512, no compiler, the build fails, or
SPECDEC_CPU_KERNEL=0 — `few_rows_linear` returns None and callers keep torch's own paths.
"""
from __future__ import annotations

import ctypes
import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
from functools import cache
from pathlib import Path

import torch

SOURCE = Path(__file__).with_name("few_rows.cpp")
FLAGS = ["-O3", "-mavx512f", "-mfma", "-fopenmp", "-shared", "-fPIC"]
MAX_ROWS = 8  # the kernel's limit; kv.rows_linear decides which row counts it serves


def _cache_dir() -> Path:
    return Path(os.environ.get("SPECDEC_CACHE", Path.home() / ".cache" / "specdec")) / "kernels"


def _build(compiler: str) -> Path:
    """Compile the kernel once per source/flags/compiler; a finished build is renamed into place atomically."""
    key = hashlib.sha256(SOURCE.read_bytes() + " ".join([compiler, *FLAGS]).encode()).hexdigest()[:16]
    lib = _cache_dir() / f"few_rows-{key}.so"
    if not lib.exists():
        lib.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(suffix=".so", dir=lib.parent)
        os.close(fd)
        try:
            subprocess.run([compiler, *FLAGS, str(SOURCE), "-o", tmp], check=True, capture_output=True, timeout=120)
            os.replace(tmp, lib)
        finally:
            Path(tmp).unlink(missing_ok=True)
    return lib


@cache
def _kernel():
    if os.environ.get("SPECDEC_CPU_KERNEL", "1") == "0" or torch.backends.cpu.get_cpu_capability() != "AVX512":
        return None
    compiler = shutil.which(os.environ.get("CXX", "g++")) or shutil.which("c++")
    if compiler is None:
        return None
    try:
        fn = ctypes.CDLL(str(_build(compiler))).few_rows_linear
    except (OSError, subprocess.SubprocessError) as e:
        detail = " ".join((getattr(e, "stderr", b"") or b"").decode(errors="replace").split())[:200]
        print(f"specdec: CPU kernel unavailable, using torch's linear layers ({e}) {detail}", file=sys.stderr)
        return None
    p, i = ctypes.c_void_p, ctypes.c_int
    fn.argtypes, fn.restype = [p, i, i, p, i, p, p, i], i
    return fn


def available() -> bool:
    return _kernel() is not None


def few_rows_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor | None:
    """F.linear(x, weight, bias) for 1..MAX_ROWS rows of fp32 CPU tensors through the kernel; None where it cannot
    serve this call (the caller then uses another path). Not differentiable: call it without autograd.
    Called ~200 times per target pass, so the checks are kept few (a call costs ~3 µs more than the kernel)."""
    fn = _kernel()
    k = x.shape[-1] if x.dim() else 0
    rows = x.numel() // k if k else 0
    if fn is None or not 1 <= rows <= MAX_ROWS or not _servable(x, weight, bias, k):
        return None
    if not x.is_contiguous():
        x = x.contiguous()
    y = x.new_empty((*x.shape[:-1], weight.shape[0]))
    fn(x.data_ptr(), rows, k, weight.data_ptr(), weight.shape[0], y.data_ptr(),
       None if bias is None else bias.data_ptr(), torch.get_num_threads())
    return y


def _servable(x, weight, bias, k) -> bool:
    """fp32 CPU tensors whose shapes fit (the kernel must never read out of bounds), weight and bias contiguous."""
    f32 = torch.float32
    if x.dtype != f32 or weight.dtype != f32 or not x.is_cpu or not weight.is_cpu or weight.dim() != 2 \
            or weight.shape[1] != k or not weight.is_contiguous():
        return False
    return bias is None or (bias.dtype == f32 and bias.is_cpu and bias.shape == weight.shape[:1]
                            and bias.is_contiguous())
