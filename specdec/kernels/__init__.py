"""specdec's own CPU kernels (rows.cpp and the headers it includes; docs/runtime.md maps them): linears on GGUF
blocks and float weights, and whole decoder layers, each output row computed independently of the rows beside it.

Built on first use with the system's C++ compiler (a few seconds) into $SPECDEC_CACHE/kernels and loaded with
ctypes; no build step at install time. Two builds of the same source: AVX-512 and AVX2 (they give the same bits).
SPECDEC_CPU_KERNEL=0 turns the kernels off, =avx2 forces the AVX2 build. Where no build can serve (no AVX2, no
compiler, a failed build) `library()` is None and callers use torch on the same dequantized values.
"""
from __future__ import annotations

import ctypes
import hashlib
import os
import re
import shutil
import subprocess
import sys
import tempfile
from functools import cache
from pathlib import Path

import torch

from ..cachedir import cache_root
from ..runtime.progress import Step
from . import abi, formats
from .formats import BF16, F16, F32, Q2_K, Q3_K, Q4_0, Q4_1, Q4_K, Q5_0, Q5_1, Q5_K, Q6_K, Q8_0  # noqa: F401

SOURCE = Path(__file__).with_name("rows.cpp")  # the one compile unit; it includes the headers beside it
COMMON = ["-O3", "-ffp-contract=off", "-fopenmp", "-shared", "-fPIC"]  # no fused multiply-add unless written
# avx512 includes VNNI (vpdpbusd, the q8 mode's integer dot products); an AVX-512 CPU without it runs the avx2 build
ISA_FLAGS = {"avx512": ["-mavx512f", "-mavx512bw", "-mavx512dq", "-mavx512vnni", "-mfma", "-mf16c"],
             "avx2": ["-mavx2", "-mfma", "-mf16c"]}
NUMERICS = ("exact", "q8")
# q8 passes of 9+ rows: wide VNNI tiles of 9..16 rows (rows_wide; SPECDEC_WIDE=0: 8-row tiles), or with SPECDEC_AMX=1
# AMX tiles from AMX_ROWS rows where the CPU has them. Wide VNNI tiles cost no more than AMX ones at any size measured
# and less at 9..12 rows (docs/numerics.md), so AMX is off unless asked. The same bits every way.
AMX_ROWS = 9
MAX_ROWS = 8  # few_rows_linear serves up to this many rows (kv.rows_linear decides which row counts it asks for)

FORMATS = formats.NAMES  # ggml's type id -> name, for the formats the kernels serve (formats.TABLE)
TORCH_FORMAT = {torch.float32: F32, torch.float16: F16, torch.bfloat16: BF16}


def _cache_dir() -> Path:
    return cache_root() / "kernels"


COMPILE_S = 25.0  # one build (one source file, one core: 25 s on the 2-core EPYC): what its progress line expects


def _build(compiler: str, isa: str, where: str | None = None) -> Path:
    """Compile once per source/flags/compiler (into `where`, default the cache); a finished build is renamed into
    place atomically."""
    flags = [*COMMON, *ISA_FLAGS[isa], *(_amx_flags(compiler) if isa == "avx512" else [])]
    key = hashlib.sha256(_sources() + " ".join([compiler, *flags]).encode()).hexdigest()[:16]
    lib = Path(where or _cache_dir()) / f"rows-{isa}-{key}.so"
    if not lib.exists():
        lib.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(suffix=".so", dir=lib.parent)
        os.close(fd)
        try:
            with Step(f"compiling the {isa} kernels (once per machine and release)", COMPILE_S,
                      quiet=where is not None):
                subprocess.run([compiler, *flags, str(SOURCE), "-o", tmp], check=True, capture_output=True, timeout=300)
            os.chmod(tmp, 0o755)  # mkstemp makes it 0600: other users of a shared cache must be able to load it
            os.replace(tmp, lib)
        finally:
            Path(tmp).unlink(missing_ok=True)
    return lib


@cache
def _amx_flags(compiler: str) -> list[str]:
    """AMX-INT8's tile instructions for the avx512 build where the compiler knows them (GCC 11, Clang 12 and later);
    they run only where rows_amx finds the CPU and the OS grant them (q8_amx.h). The compiler is asked once and
    its answer kept in the cache (asking costs a process start, a tenth of a second, on every load)."""
    flags = ["-mamx-tile", "-mamx-int8"]
    real = Path(compiler).resolve()
    key = hashlib.sha256(f"{real} {real.stat().st_mtime_ns} {' '.join(flags)}".encode()).hexdigest()[:16]
    answer = _cache_dir() / f"amx-{key}"
    try:
        return flags if answer.read_text() == "1" else []
    except OSError:
        pass
    try:
        ok = subprocess.run([compiler, *flags, "-x", "c++", "-fsyntax-only", "-"], input=b"#include <immintrin.h>\n",
                            capture_output=True, timeout=60).returncode == 0
    except (OSError, subprocess.SubprocessError):
        ok = False
    try:
        answer.parent.mkdir(parents=True, exist_ok=True)
        answer.write_text("1" if ok else "0")
    except OSError:
        pass  # an unwritable cache: ask again next time
    return flags if ok else []


def _sources() -> bytes:
    """rows.cpp and every header it includes: a change to any of them is a new build (a header missing from an
    installed copy is an OSError here: the kernels are off with one line, never built from a partial source)."""
    return b"".join(SOURCE.with_name(name).read_bytes() for name in (SOURCE.name, *headers()))


def headers() -> list[str]:
    """The headers rows.cpp includes from its own folder, in its order."""
    return re.findall(r'^#include "([\w.]+)"', SOURCE.read_text(), re.M)


def best_isa() -> str | None:
    """The instruction set this machine's kernels use: avx512, avx2, or None (torch's paths)."""
    choice = os.environ.get("SPECDEC_CPU_KERNEL", "1").lower()
    if choice == "0":
        return None
    cap = torch.backends.cpu.get_cpu_capability()
    if cap in ("AVX512", "AVX512_BF16", "AMX") and choice != "avx2" and _has_vnni():
        return "avx512"
    return "avx2" if cap.startswith(("AVX2", "AVX512", "AMX")) else None


def _has_vnni() -> bool:
    return "avx512_vnni" in cpuinfo("flags").split()


class Library:
    """The compiled kernels of one instruction set, with their ctypes signatures."""

    def __init__(self, path: Path, isa: str):
        lib, p, i, f, lng = ctypes.CDLL(str(path)), ctypes.c_void_p, ctypes.c_int, ctypes.c_float, ctypes.c_long
        self.isa = isa
        self.key, self.path = path.stem, path  # rows-<isa>-<hash of source, flags, compiler>: what a layout depends on
        self.rows_linear = lib.rows_linear
        self.rows_linear.argtypes, self.rows_linear.restype = [i, p, i, i, p, p, i, p, p, i], i
        self.rows_repack = lib.rows_repack
        self.rows_repack.argtypes, self.rows_repack.restype = [i, p, i, i, p, i], i
        self.rows_repacked_bytes = lib.rows_repacked_bytes
        self.rows_repacked_bytes.argtypes, self.rows_repacked_bytes.restype = [i, i, i], lng
        self.row_bytes = lib.row_bytes
        self.row_bytes.argtypes, self.row_bytes.restype = [i, i], lng
        self.rows_dequantize = lib.rows_dequantize
        self.rows_dequantize.argtypes, self.rows_dequantize.restype = [i, p, i, i, p, i, p], i
        self.rows_rmsnorm = lib.rows_rmsnorm
        self.rows_rmsnorm.argtypes, self.rows_rmsnorm.restype = [p, i, i, p, f, p, i], None
        self.decoder_layers = lib.decoder_layers
        self.decoder_layers.argtypes, self.decoder_layers.restype = [p, p, i, p, i, p, p, p, i], i
        self.decoder_layers_from = lib.decoder_layers_from
        self.decoder_layers_from.argtypes, self.decoder_layers_from.restype = [p, p, i, i, p, i, p, p, p, i], i
        self.rows_topk = lib.rows_topk
        self.rows_topk.argtypes, self.rows_topk.restype = [p, i, i, i, p, p, p, i], None
        self.rows_argmax = lib.rows_argmax
        self.rows_argmax.argtypes, self.rows_argmax.restype = [p, i, i, p, i], None
        self.rows_race = lib.rows_race
        self.rows_race.argtypes, self.rows_race.restype = [p, i, i, p, p, i], None
        # q8 tiles of at least AMX_ROWS rows take AMX tile multiplies with SPECDEC_AMX=1 where the CPU and the OS
        # allow; else wide VNNI tiles (SPECDEC_WIDE=0: 8-row ones). The same bits every way. amx_rows: the threshold
        # in force (0: off); wide: 1 where wide tiles run.
        self.rows_amx, self.rows_wide = _switch(lib, "rows_amx"), _switch(lib, "rows_wide")
        self.amx_rows = self.rows_amx(AMX_ROWS if env_switch("SPECDEC_AMX", False) else 0)
        self.wide = self.rows_wide(1 if env_switch("SPECDEC_WIDE", True) else 0)
        # how far ahead q8 tiles prefetch weights (one-row tiles, the others, the others into L2): chosen for this
        # CPU, no bit changes
        self.rows_prefetch = _prefetch(lib)
        self.prefetch = self.set_prefetch(*prefetch_distances())
        rows_abi = lib.rows_abi
        rows_abi.argtypes, rows_abi.restype = [p, i], i
        abi.check(rows_abi)  # the structs decoder_layers takes, against their mirrors: a mismatch never runs
        rows_formats = lib.rows_formats
        rows_formats.argtypes, rows_formats.restype = [p, i], i
        formats.check(rows_formats)  # and the format table, against formats.TABLE

    def tilings(self) -> dict[str, tuple[int, int]]:
        """(rows_amx, rows_wide) of each q8 tiling this build and CPU run: "8-row" VNNI tiles, "wide" ones of 9..16
        rows (AVX-512 VNNI builds), "amx" tiles (where the CPU and the OS allow). Leaves the tiling in force."""
        out = {"8-row": (0, 0)}
        if self.rows_wide(1):
            out["wide"] = (0, 1)
        if self.rows_amx(AMX_ROWS):
            out["amx"] = (AMX_ROWS, 0)
        self.rows_amx(self.amx_rows), self.rows_wide(self.wide)
        return out

    def set_prefetch(self, one: int = -1, many: int = -1, l2: int = -1) -> tuple[int, int, int]:
        """Bytes q8 tiles prefetch ahead: `one` for one-row tiles (decode steps), `many` for the others, `l2` for
        the others' second prefetch into L2 (0: none); -1 keeps one; multiples of 64 up to 64 KB. Returns the three
        in force (None for a build without them)."""
        self.prefetch = self.rows_prefetch(one, many, l2)
        return self.prefetch


def _prefetch(lib):
    """rows_prefetch3 as a function of (one, many, l2) -> the distances in force. Older builds
    (benchmarks/runtime.py same-kernels loads them) have rows_prefetch(one, many) without the L2 distance (reported as 0),
    or none at all (a stand-in returning None)."""
    i, p = ctypes.c_int, ctypes.c_void_p
    if hasattr(lib, "rows_prefetch3"):
        fn = lib.rows_prefetch3
        fn.argtypes, fn.restype = [i, i, i, p], None

        def call(one: int, many: int, l2: int) -> tuple[int, int, int]:
            out = (ctypes.c_int * 3)()
            fn(one, many, l2, out)
            return out[0], out[1], out[2]
        return call
    if hasattr(lib, "rows_prefetch"):
        old = lib.rows_prefetch
        old.argtypes, old.restype = [i, i, p], None

        def call_old(one: int, many: int, l2: int) -> tuple[int, int, int]:
            out = (ctypes.c_int * 2)()
            old(one, many, out)
            return out[0], out[1], 0
        return call_old
    return lambda one, many, l2: None


# Bytes q8 tiles prefetch ahead (one-row tiles, the others, the others' second prefetch into L2; 0: none), by CPU
# vendor: the 1.5B pair's passes measured with benchmarks/runtime.py ab-curve and benchmarks/runtime.py prefetch-ab (docs/runtime.md,
# "Prefetch"). SPECDEC_Q8_AHEAD=ONE[,MANY[,L2]] overrides.
PREFETCH = {"GenuineIntel": (2048, 4096, 0), "AuthenticAMD": (0, 8192, 16384)}
PREFETCH_OTHER = (2048, 4096, 0)


def env_switch(name: str, default: bool) -> bool:
    """An on/off environment variable: 1 or 0, else `default` (a malformed value says so in one line)."""
    value = os.environ.get(name, "").strip()
    if value in ("0", "1"):
        return value == "1"
    if value:
        print(f"specdec: {name}={value!r} is not 0 or 1; using {int(default)}", file=sys.stderr)
    return default


def prefetch_distances() -> tuple[int, int, int]:
    """(one-row, more-row, more-row into L2) prefetch distances for this machine: SPECDEC_Q8_AHEAD where it is well
    formed (MANY defaults to ONE, L2 to none), else the CPU vendor's row of PREFETCH."""
    env = os.environ.get("SPECDEC_Q8_AHEAD", "").strip()
    if env:
        try:
            vals = [int(v) for v in env.split(",")]
            if not 1 <= len(vals) <= 3 or not all(0 <= v <= 65536 for v in vals):
                raise ValueError
            return vals[0], vals[min(1, len(vals) - 1)], vals[2] if len(vals) == 3 else 0
        except ValueError:
            print(f"specdec: SPECDEC_Q8_AHEAD={env!r} is not ONE[,MANY[,L2]] bytes (0..65536); using this CPU's",
                  file=sys.stderr)
    return PREFETCH.get(cpuinfo("vendor_id"), PREFETCH_OTHER)


def cpuinfo(field: str) -> str:
    """The first value of `field` in /proc/cpuinfo (vendor_id: GenuineIntel, AuthenticAMD; model name), or ''."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.split(":", 1)[0].strip() == field:
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return ""


def _switch(lib, name: str):
    """A tile switch, `name`(int) -> the setting in force, or a stand-in returning 0 for an older build that lacks
    it (benchmarks/runtime.py same-kernels loads them)."""
    try:
        switch = getattr(lib, name)
    except AttributeError:
        return lambda value: 0
    switch.argtypes, switch.restype = [ctypes.c_int], ctypes.c_int
    return switch


@cache
def library(isa: str | None = None) -> Library | None:
    """The kernels for `isa` (default: best_isa()), built on first use; None where they cannot serve."""
    isa = isa or best_isa()
    compiler = shutil.which(os.environ.get("CXX", "g++")) or shutil.which("c++")
    if isa is None or compiler is None:
        why = ("SPECDEC_CPU_KERNEL=0" if os.environ.get("SPECDEC_CPU_KERNEL") == "0" else "no C++ compiler"
               if isa else "this CPU has no AVX2")
        print(f"specdec: CPU kernels off ({why}); the runtime runs torch one row at a time: {FALLBACK}",
              file=sys.stderr)
        return None
    try:
        path = _build(compiler, isa)
        try:
            return Library(path, isa)
        except OSError as e:  # a cached build this user cannot load (another user's, unreadable): build a private one
            print(f"specdec: cached CPU kernel {path} cannot be loaded ({e}); building a private copy", file=sys.stderr)
            return Library(_build(compiler, isa, tempfile.mkdtemp(prefix="specdec-kernels-")), isa)
    except (OSError, subprocess.SubprocessError) as e:
        detail = " ".join((getattr(e, "stderr", b"") or b"").decode(errors="replace").split())[:200]
        print(f"specdec: CPU kernel unavailable, using torch's paths ({e}) {detail}", file=sys.stderr)
        return None


FALLBACK = "row-invariant, not bitwise equal to the kernels, several times slower"


def available() -> bool:
    return library() is not None


def path_name() -> str:
    """Which arithmetic the runtime runs here, as `check` and `bench` report it."""
    lib = library()
    return f"kernels ({lib.isa})" if lib is not None else "torch fallback (one row at a time)"


def q8_format(fmt: int) -> bool:
    """Weight formats the q8 mode runs in integers (int8 activations); the others keep the exact path. Q5_0 runs as
    its own bytes (nibbles and a plane of fifth bits), Q4_K as its own bytes (scales decoded in the tile, exact fp32 products), Q6_K as
    bytes with its 16-column sub-blocks' scales in fp16, Q5_K and Q5_1 as bytes with Q4_1's scale and min, Q3_K and
    Q2_K as nibbles with their sub-blocks' scales (and mins) in fp16 (formats.h FORMAT_TABLE's q8 column; fp16 scales
    are stored times 2^8, and a tensor whose scales even that cannot hold runs exact)."""
    return fmt in formats.BY_ID and formats.BY_ID[fmt].q8 != 0


class NotRepackable(ValueError):
    """A K-quant tensor whose sub-block scales fp16 cannot hold: it runs on the exact kernels in q8 mode too."""


def repacked_bytes(fmt: int, n: int, k: int, lib: Library | None = None) -> int:
    """Bytes of repack()'s layout of n rows of k columns (rows padded to 16), or -1 where q8 cannot repack it."""
    return (lib or library()).rows_repacked_bytes(fmt, n, k)


def repack(fmt: int, weight: torch.Tensor, n: int, k: int, lib: Library | None = None,
           out: torch.Tensor | None = None) -> torch.Tensor:
    """`n` rows of GGUF blocks -> the q8 kernel's layout (q8_repack.h, `rows_repack`: groups of 16 rows, their quants
    interleaved 4 columns at a time): the same bytes, rows padded to a multiple of 16."""
    lib = lib or library()
    size = lib.rows_repacked_bytes(fmt, n, k)
    if size < 0 or tuple(weight.shape) != (n, lib.row_bytes(fmt, k)) or not weight.is_contiguous():
        raise ValueError(f"cannot repack {tuple(weight.shape)} as {n} rows of {FORMATS.get(fmt, fmt)} with {k} columns")
    if out is None:
        out = torch.empty(size, dtype=torch.uint8)
    elif out.dtype != torch.uint8 or out.numel() != size or not out.is_contiguous():
        raise ValueError(f"repack: `out` must be {size} contiguous bytes")
    if lib.rows_repack(fmt, weight.data_ptr(), n, k, out.data_ptr(), torch.get_num_threads()) == -2:
        raise NotRepackable(f"{FORMATS[fmt]} scales beyond fp16's precision")
    return out


def linear(fmt: int, x: torch.Tensor, weight: torch.Tensor, n: int, bias: torch.Tensor | None = None,
           lib: Library | None = None, q8: bool = False, packed: torch.Tensor | None = None) -> torch.Tensor:
    """y = x·Wᵀ (+ b) for W given as `n` rows in format `fmt` (a uint8 block tensor, or a float tensor) and x
    [..., K] fp32 CPU, any number of rows. q8: int8 activations for the block formats q8_format lists (rows.cpp),
    on `packed` (repack()'s layout of W) or on a repack made for this call. Shapes and dtypes are checked here: a
    pointer never reaches C++ with a size that does not match its tensor."""
    lib = lib or library()
    k = x.shape[-1] if x.dim() else 0
    if x.dtype != torch.float32 or not x.is_cpu:
        raise ValueError(f"kernel linear needs fp32 CPU rows, got {x.dtype} on {x.device}")
    rb = lib.row_bytes(fmt, k)
    if rb < 0 or weight.dim() != 2 or tuple(weight.shape) != (n, rb) or weight.element_size() != 1 \
            or not weight.is_contiguous():
        raise ValueError(f"kernel linear: weight {tuple(weight.shape)} is not {n} contiguous rows of {rb} bytes "
                         f"({FORMATS.get(fmt, fmt)} with {k} columns)")
    if bias is not None and (bias.dtype != torch.float32 or tuple(bias.shape) != (n,) or not bias.is_contiguous()):
        raise ValueError(f"kernel linear: bias must be fp32 [{n}]")
    if q8 and q8_format(fmt):
        if packed is None:
            try:
                packed = repack(fmt, weight, n, k, lib)
            except NotRepackable:
                packed = None
        elif packed.dtype != torch.uint8 or packed.numel() != lib.rows_repacked_bytes(fmt, n, k):
            raise ValueError("kernel linear: `packed` is not this weight's repack")
    else:
        packed = None
    x2 = x.reshape(-1, k)
    if not x2.is_contiguous():
        x2 = x2.contiguous()
    y = x.new_empty((*x.shape[:-1], n))
    rc = lib.rows_linear(fmt, x2.data_ptr(), x2.shape[0], k, weight.data_ptr(),
                         None if packed is None else packed.data_ptr(), n, y.data_ptr(),
                         None if bias is None else bias.data_ptr(), torch.get_num_threads())
    if rc:
        raise ValueError(f"kernel cannot serve format {FORMATS.get(fmt, fmt)} with {k} columns")
    return y


def dequantize_rows(fmt: int, weight: torch.Tensor, n: int, k: int, idx: torch.Tensor,
                    lib: Library | None = None) -> torch.Tensor:
    """Rows `idx` of W (`n` rows of `fmt`, `k` columns, a uint8 block tensor) as fp32 [len(idx), k]: gguf's reference
    values, the weights the kernels multiply by (an embedding lookup)."""
    lib = lib or library()
    rb = lib.row_bytes(fmt, k)
    if rb < 0 or weight.dtype != torch.uint8 or tuple(weight.shape) != (n, rb) or not weight.is_contiguous():
        raise ValueError(f"dequantize_rows: weight {tuple(weight.shape)} is not {n} contiguous rows of {rb} bytes "
                         f"({FORMATS.get(fmt, fmt)} with {k} columns)")
    idx = idx.to(torch.long).contiguous()
    if idx.dim() != 1 or (len(idx) and (int(idx.min()) < 0 or int(idx.max()) >= n)):
        raise ValueError(f"dequantize_rows: row ids must be 0..{n - 1}")
    out = torch.empty(len(idx), k)
    if lib.rows_dequantize(fmt, weight.data_ptr(), n, k, idx.data_ptr(), len(idx), out.data_ptr()):
        raise ValueError(f"kernel cannot dequantize format {FORMATS.get(fmt, fmt)} with {k} columns")
    return out


def decoder_layers(lib: Library, dims: abi.Dims, layers, x: torch.Tensor, slots: list[int], positions: list[int],
                   tree: list[int] | None = None, first: int = 0, count: int | None = None) -> None:
    """Every decoder layer of one pass, in place on the residual stream x [R, hidden] (fp32, contiguous): row r at
    position positions[r] of KV slot slots[r], its K/V written there first. `layers`: a ctypes array of abi.Layer;
    `tree`: [store R | kbase R | moff R | map...] for a tree pass (layer.h Tree), else None. `first`, `count`: only
    those layers (a pass in pieces, decoder_layers_from), the whole array's structs given. The kernel checks
    every position and block against `dims` and refuses (RuntimeError) rather than read out of bounds."""
    R = len(slots)
    if x.dtype != torch.float32 or not x.is_contiguous() or x.dim() != 2 or len(x) != R or len(positions) != R:
        raise ValueError("decoder_layers: x must be contiguous fp32 [rows, hidden] with one slot and position a row")
    s, p = (ctypes.c_int * R)(*slots), (ctypes.c_int * R)(*positions)
    t = None if tree is None else (ctypes.c_int * len(tree))(*tree)
    if first or count is not None:  # a piece of the pass: layers first .. first + count - 1
        count = len(layers) - first if count is None else count
        at = ctypes.cast(ctypes.addressof(layers) + first * ctypes.sizeof(abi.Layer), ctypes.c_void_p)
        failed = lib.decoder_layers_from(ctypes.byref(dims), at, first, count, x.data_ptr(), R, s, p, t,
                                         torch.get_num_threads())
    else:
        failed = lib.decoder_layers(ctypes.byref(dims), layers, len(layers), x.data_ptr(), R, s, p, t,
                                    torch.get_num_threads())
    if failed:
        raise RuntimeError("the decoder kernel refused its shapes")


def rmsnorm(x: torch.Tensor, weight: torch.Tensor, eps: float, lib: Library | None = None) -> torch.Tensor:
    """RMSNorm of each row of x [R, D] (fp32, contiguous) by weight [D]: norms.h's rmsnorm_row, row by row."""
    lib = lib or library()
    if x.dtype != torch.float32 or x.dim() != 2 or not x.is_contiguous() or weight.dtype != torch.float32 \
            or tuple(weight.shape) != (x.shape[1],) or not weight.is_contiguous():
        raise ValueError("rmsnorm: x must be contiguous fp32 [rows, D] and weight fp32 [D]")
    out = torch.empty_like(x)
    lib.rows_rmsnorm(x.data_ptr(), x.shape[0], x.shape[1], weight.data_ptr(), eps, out.data_ptr(),
                     min(torch.get_num_threads(), max(1, x.shape[0])))
    return out


def topk(logits: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(indices int32 [R, k], probabilities [R, k]) of each row's k largest logits; the probabilities are
    exp(logit - logsumexp(row)), the row's softmax. One kernel call where the kernels serve, else torch."""
    x = logits.float().contiguous()
    lib = library()
    if lib is None or x.dim() != 2 or not 0 < k <= x.shape[1]:
        top = x.topk(k, -1)
        return top.indices.int(), (top.values - torch.logsumexp(x, -1, keepdim=True)).exp()
    R = x.shape[0]
    idx, val, lse = torch.empty(R, k, dtype=torch.int32), torch.empty(R, k), torch.empty(R, 1)
    lib.rows_topk(x.data_ptr(), R, x.shape[1], k, idx.data_ptr(), val.data_ptr(), lse.data_ptr(),
                  min(torch.get_num_threads(), R))
    return idx, (val - lse).exp()


def argmax(logits: torch.Tensor, lib: Library | None = None) -> list[int]:
    """Each row's argmax as a list, torch.argmax(-1)'s, in one kernel call where the kernels serve (several times
    faster than torch's on a 49k vocabulary; other dtypes, and rows with a NaN or an infinity, go to torch)."""
    lib = lib or library()
    if lib is None or logits.dtype != torch.float32 or logits.dim() != 2 or logits.shape[1] == 0:
        return logits.argmax(-1).tolist()
    x = logits.contiguous()
    out = torch.empty(x.shape[0], dtype=torch.long)
    lib.rows_argmax(x.data_ptr(), x.shape[0], x.shape[1], out.data_ptr(), min(torch.get_num_threads(), x.shape[0]))
    return [a if a >= 0 else int(row.argmax()) for a, row in zip(out.tolist(), x)]  # -1: NaN or inf, torch's rule


def race(probs: torch.Tensor, keys: list[int], lib: Library | None = None) -> list[int]:
    """Seeded sampling's exponential race (sampling.PositionNoise): per row r of probs [n, V], argmax_v p(v) / E(v)
    with E = -log u, u the counter-based uniforms of keys[r]. The kernel takes a handful of logarithms a row; torch
    (no kernels, or a row without a positive entry) takes them all."""
    from .reference.selection import as_int64, uniforms
    lib = lib or library()
    p = probs.double().contiguous()
    out = [-1] * len(p)
    if lib is not None and p.dim() == 2 and p.shape[1] > 0:
        keyed = torch.tensor([as_int64(k) for k in keys], dtype=torch.long)
        got = torch.empty(len(p), dtype=torch.long)
        lib.rows_race(p.data_ptr(), len(p), p.shape[1], keyed.data_ptr(), got.data_ptr(),
                      min(torch.get_num_threads(), len(p)))
        out = got.tolist()
    return [w if w >= 0 else int((row / -torch.log(uniforms(k, torch.arange(len(row))))).argmax())
            for w, row, k in zip(out, p, keys)]


def few_rows_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor | None:
    """F.linear(x, weight, bias) for 1..MAX_ROWS rows of fp32 CPU tensors (the transformers backend's decode and
    verify linears); None where the kernel cannot serve this call (the caller then uses another path). Not
    differentiable: call it without autograd. Called ~200 times per target pass, so the checks are kept few."""
    lib = library()
    k = x.shape[-1] if x.dim() else 0
    rows = x.numel() // k if k else 0
    if lib is None or not 1 <= rows <= MAX_ROWS or not _servable(x, weight, bias, k):
        return None
    if not x.is_contiguous():
        x = x.contiguous()
    y = x.new_empty((*x.shape[:-1], weight.shape[0]))
    lib.rows_linear(F32, x.data_ptr(), rows, k, weight.data_ptr(), None, weight.shape[0], y.data_ptr(),
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
