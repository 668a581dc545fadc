"""Weights in their file's form: GGUF tensors memory-mapped (a compact reader of the GGUF layout below; quantized
blocks never expanded), safetensors tensors in their own dtype. A linear's weight is a QTensor: n rows of k columns in one
format; the kernels read it as it is, and `dequantize` gives exactly gguf's reference values (torch fallback)."""
from __future__ import annotations

import functools

import struct
import warnings
from dataclasses import dataclass, field

import numpy as np
import torch
from torch.nn import functional as F

from .. import kernels
from ..kernels import formats

GGML_BLOCK = {f.id: (f.block, f.bytes) for f in formats.TABLE if not f.is_float}  # columns, bytes per block
FLOAT_BYTES = {f.id: f.bytes for f in formats.TABLE if f.is_float}
FLOAT_DTYPE = {kernels.F32: torch.float32, kernels.F16: torch.float16, kernels.BF16: torch.bfloat16}


REPACK_ROWS = 8192  # rows repacked at a time (a multiple of the q8 layout's 16-row groups)


class Unsupported(ValueError):
    """A file or architecture the runtime does not run (the transformers backend may)."""


@dataclass(eq=False)
class QTensor:
    """n rows of k columns in ggml format `fmt`: `data` is [n, row bytes] uint8 (a view of the file where possible)."""
    fmt: int
    data: torch.Tensor
    n: int
    k: int
    _dense: torch.Tensor | None = field(default=None, repr=False)
    _packed: torch.Tensor | None = field(default=None, repr=False)
    _exact_only: bool = field(default=False, repr=False)  # q8 cannot repack it (kernels.NotRepackable)
    mapped: bool = False  # `data` is a read-only memory map of a file (GGUF): its pages can be dropped and re-read

    @classmethod
    def from_float(cls, w: torch.Tensor) -> QTensor:
        w = w.detach().contiguous()
        if w.dtype not in kernels.TORCH_FORMAT:
            w = w.float()
        fmt = kernels.TORCH_FORMAT[w.dtype]
        return cls(fmt, w.view(torch.uint8).reshape(w.shape[0], -1), w.shape[0], w.shape[1])

    @property
    def format_name(self) -> str:
        return kernels.FORMATS[self.fmt]

    def take(self, rows) -> QTensor:
        """A copy of some rows (the head rows of a feature draft's reduced vocabulary)."""
        rows = torch.as_tensor(rows, dtype=torch.long)
        return QTensor(self.fmt, self.data[rows].contiguous(), len(rows), self.k)

    def first(self, n: int) -> QTensor:
        """Rows 0..n-1 as a tensor of their own: views of the same bytes, and of the q8 layout where it exists and n
        is a whole number of its 16-row groups (else the first use repacks them)."""
        out = QTensor(self.fmt, self.data[:n], n, self.k, mapped=self.mapped)
        if self._packed is not None and n % 16 == 0:
            out._packed = self._packed[: kernels.repacked_bytes(self.fmt, n, self.k)]
        out._exact_only = self._exact_only
        return out

    def split(self, sizes: list[int]) -> list[QTensor]:
        """Consecutive row ranges as tensors of their own, views of the same bytes (a fused qkv or gate/up)."""
        if sum(sizes) != self.n:
            raise Unsupported(f"a fused matrix of {self.n} rows cannot split as {sizes}: the file and its config disagree")
        out, start = [], 0
        for size in sizes:
            out.append(QTensor(self.fmt, self.data[start:start + size], size, self.k, mapped=self.mapped))
            start += size
        return out

    def rows(self, idx) -> torch.Tensor:
        """Rows `idx` dequantized to fp32 [len(idx), k] (embedding lookups): by the kernels where they run (gguf's
        numpy reference for K-quants took 0.1-0.6 ms a lookup), else in torch or by gguf; the same values."""
        idx = torch.as_tensor(idx, dtype=torch.long)
        if self.fmt not in FLOAT_DTYPE and kernels.available() and self.data.is_contiguous():
            return kernels.dequantize_rows(self.fmt, self.data, self.n, self.k, idx.reshape(-1))
        return _dequantize(self.fmt, self.data[idx], self.k)

    def packed(self) -> torch.Tensor | None:
        """The blocks repacked for the q8 kernel (kernels.repack; made once, the same bytes again), or None for
        formats the q8 mode runs exactly (float weights)."""
        if self._packed is None and self.repacked_bytes() is not None:
            self._packed = self.pack_into(torch.empty(self.repacked_bytes(), dtype=torch.uint8))
        return self._packed

    def repacked_bytes(self) -> int | None:
        """Bytes of the q8 layout, or None where q8 runs this tensor exactly (float weights, NotRepackable)."""
        if not kernels.q8_format(self.fmt) or self._exact_only:
            return None
        return kernels.repacked_bytes(self.fmt, self.n, self.k)

    def pack_into(self, out: torch.Tensor) -> torch.Tensor | None:
        """Repack into `out` (repacked_bytes() bytes: memory, or a cache file's map) in slices of rows, each slice's
        file pages dropped once copied (q8 reads the copy; they are re-read if ever needed): the file and its copy
        are never both resident (a 1B model's head is 215 MB). None if the scales do not fit (runs exact)."""
        lib, at = kernels.library(), 0
        for r0 in range(0, self.n, REPACK_ROWS):
            rows = self.data[r0: r0 + REPACK_ROWS]
            size = kernels.repacked_bytes(self.fmt, len(rows), self.k, lib)
            try:
                kernels.repack(self.fmt, rows, len(rows), self.k, lib, out=out[at: at + size])
            except kernels.NotRepackable:
                self._exact_only = True
                return None
            at += size
            if self.mapped:
                release_pages(rows)
        return out

    def use_packed(self, packed: torch.Tensor | None) -> None:
        """Take a q8 layout made before (a cache file's map); None: this tensor runs exact in q8."""
        self._packed, self._exact_only = packed, packed is None

    def dequantize(self) -> torch.Tensor:
        """All rows in fp32, exactly as gguf's reference dequantizes them (cached: torch fallback and tests)."""
        if self._dense is None:
            self._dense = _dequantize(self.fmt, self.data, self.k)
        return self._dense


def release_pages(t: torch.Tensor) -> None:
    """Drop the pages of a file-mapped tensor from this process's memory (madvise MADV_DONTNEED; the pages it shares
    with its neighbours too): the bytes stay in the file, and a later read faults them back in. Only for read-only
    file maps: on anonymous memory the same call would zero the data."""
    release_range(t.data_ptr(), t.numel() * t.element_size())


def release_range(start: int, nbytes: int) -> None:
    """release_pages for `nbytes` of a read-only file map at address `start`."""
    import ctypes
    import mmap
    page = mmap.PAGESIZE
    first, last = start // page * page, -(-(start + nbytes) // page) * page
    if last > first and hasattr(mmap, "MADV_DONTNEED"):
        _libc().madvise(ctypes.c_void_p(first), ctypes.c_size_t(last - first), mmap.MADV_DONTNEED)


@functools.cache
def _libc():
    """The C library's handle, opened once (a start releases a model's file pages about 200 times: 0.1 s)."""
    import ctypes
    return ctypes.CDLL(None)


def scales_of(fmt: int, data: torch.Tensor) -> torch.Tensor:
    """The blocks' fp16 scales widened to fp32 (exact): [n, blocks, 1] d, or [n, blocks, 2] d and m (Q4_1)."""
    cols, nbytes = GGML_BLOCK[fmt]
    blocks = data.view(data.shape[0], -1, nbytes)
    halves = blocks[..., : 4 if fmt == kernels.Q4_1 else 2].contiguous().view(torch.float16)
    return halves.float().contiguous()


def _dequantize(fmt: int, data: torch.Tensor, k: int) -> torch.Tensor:
    """fp32 rows exactly as gguf's reference computes them (d*q for Q8_0, d*(q-8) for Q4_0, d*q + m for Q4_1, in
    fp32, a multiply then an add), in torch: an embedding lookup costs tens of microseconds, not a numpy pass."""
    if fmt in FLOAT_DTYPE:
        return data.contiguous().view(FLOAT_DTYPE[fmt]).reshape(-1, k).float()
    if fmt not in (kernels.Q4_0, kernels.Q4_1, kernels.Q8_0):  # 5-bit and K-quant blocks: gguf's own reference
        import gguf
        rows = gguf.quants.dequantize(data.contiguous().numpy(), gguf.GGMLQuantizationType(fmt))
        return torch.from_numpy(np.ascontiguousarray(rows, dtype=np.float32)).reshape(-1, k)
    cols, nbytes = GGML_BLOCK[fmt]
    n = data.shape[0]
    if n <= 8:  # a few rows (a decode step's lookups): numpy's per-call cost is a tenth of torch's, the same math
        return torch.from_numpy(_dequantize_numpy(fmt, data.numpy().reshape(n, -1, nbytes), n, k))
    blocks = data.reshape(n, -1, nbytes)
    sc = scales_of(fmt, data)
    if fmt == kernels.Q8_0:
        q = blocks[..., 2:].contiguous().view(torch.int8).float()
        return (q * sc[..., :1]).reshape(n, k)
    packed = blocks[..., 4 if fmt == kernels.Q4_1 else 2:].long()
    q = torch.cat([packed & 15, packed >> 4], -1).float()  # weight j < 16: low nibble of byte j; j >= 16: high
    if fmt == kernels.Q4_0:
        return (sc[..., :1] * (q - 8)).reshape(n, k)
    return (sc[..., :1] * q + sc[..., 1:2]).reshape(n, k)


def _dequantize_numpy(fmt: int, blocks: np.ndarray, n: int, k: int) -> np.ndarray:
    """_dequantize's formula for Q8_0, Q4_0 and Q4_1 blocks [n, blocks, bytes], in numpy (fp32, bitwise equal)."""
    head = 4 if fmt == kernels.Q4_1 else 2
    sc = np.ascontiguousarray(blocks[..., :head]).view(np.float16).astype(np.float32)  # [n, blocks, 1 or 2]
    if fmt == kernels.Q8_0:
        return (np.ascontiguousarray(blocks[..., 2:]).view(np.int8).astype(np.float32) * sc[..., :1]).reshape(n, k)
    packed = blocks[..., head:]
    q = np.concatenate([packed & 15, packed >> 4], -1).astype(np.float32)
    if fmt == kernels.Q4_0:
        return (sc[..., :1] * (q - np.float32(8))).reshape(n, k)
    return (sc[..., :1] * q + sc[..., 1:2]).reshape(n, k)


def qlinear(x: torch.Tensor, w: QTensor, bias: torch.Tensor | None = None, q8: bool = False) -> torch.Tensor:
    """x·Wᵀ (+ b): the kernel on W's own blocks where it runs, else torch on the same dequantized values, one row
    at a time (a matrix product's summation order depends on its row count; one row's is always the same)."""
    if x.shape[-1] != w.k:
        raise ValueError(f"a linear of {w.k} columns got rows of {x.shape[-1]}")
    if kernels.library() is not None:
        packed = w.packed() if q8 else None
        return kernels.linear(w.fmt, x, w.data, w.n, bias, q8=packed is not None, packed=packed)
    rows, dense = x.reshape(-1, w.k), w.dequantize()
    out = [F.linear(rows[r:r + 1].clone(), dense, bias) for r in range(rows.shape[0])]
    return (torch.cat(out) if out else x.new_empty(0, w.n)).reshape(*x.shape[:-1], w.n)


def check_format(name: str, fmt: int, k: int) -> None:
    if fmt in FLOAT_BYTES:
        return
    if fmt not in GGML_BLOCK:
        import gguf
        try:
            tname = gguf.GGMLQuantizationType(fmt).name
        except ValueError:
            tname = str(fmt)
        raise Unsupported(f"tensor {name} is {tname}; the runtime runs "
                          f"{', '.join(f.name for f in formats.TABLE)}")
    if k % GGML_BLOCK[fmt][0]:
        raise Unsupported(f"tensor {name} has {k} columns, not a whole number of blocks")


# ---- GGUF ------------------------------------------------------------------------------------------------------
# A compact reader of the GGUF layout (header, key/values, tensor infos, aligned data): the file is memory-mapped
# once and each tensor is a view of it. The gguf package's GGUFReader builds a numpy view per array element, which
# for the default file's 97k tokenizer entries costs 2.4 s and 160 MB at every start; here arrays are skipped.
_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
_STRING, _ARRAY = 8, 9


class GGUFFile:
    """Scalar/string metadata and memory-mapped tensors of a GGUF file (nothing is read until a kernel touches it)."""

    def __init__(self, path):
        self.path = path
        try:
            self.map = np.memmap(path, dtype=np.uint8, mode="r")
            self.fields, self.tensors = self._parse(memoryview(self.map))
            # the metadata was read once (a 152k vocabulary is megabytes of strings): out of the resident set
            release_range(self.map.ctypes.data, min((off for _, _, off in self.tensors.values()), default=0))
        except (ValueError, OSError, struct.error, IndexError, UnicodeDecodeError, OverflowError, MemoryError) as e:
            raise Unsupported(f"cannot read GGUF {path}: {e or type(e).__name__}")

    def _parse(self, buf):
        if bytes(buf[:4]) != b"GGUF":
            raise ValueError("bad magic bytes")
        version, n_tensors, n_kv = struct.unpack_from("<IQQ", buf, 4)
        if version < 2:
            raise ValueError(f"GGUF version {version} is too old")
        pos, fields = 24, {}
        for _ in range(n_kv):
            key, pos = _string(buf, pos)
            (vtype,), pos = struct.unpack_from("<I", buf, pos), pos + 4
            fields[key], pos = _value(buf, pos, vtype)
        infos = []
        for _ in range(n_tensors):
            name, pos = _string(buf, pos)
            (n_dims,), pos = struct.unpack_from("<I", buf, pos), pos + 4
            dims = struct.unpack_from(f"<{n_dims}Q", buf, pos)
            pos += 8 * n_dims
            fmt, offset = struct.unpack_from("<IQ", buf, pos)
            pos += 12
            infos.append((name, dims, fmt, offset))
        align = fields.get("general.alignment", 32)
        if not isinstance(align, int) or not 0 < align <= 1 << 20:
            raise ValueError(f"general.alignment {align!r} is not a positive size")
        start = (pos + align - 1) // align * align
        return fields, {name: (dims, fmt, start + off) for name, dims, fmt, off in infos}

    def meta(self, key: str, default=None):
        return self.fields.get(key, default)

    def has(self, name: str) -> bool:
        return name in self.tensors

    def _info(self, name: str):
        if name not in self.tensors:
            raise Unsupported(f"GGUF {self.path} has no tensor {name} (its metadata and tensors disagree)")
        return self.tensors[name]

    def _bytes(self, name: str, rows: int, row_bytes: int) -> torch.Tensor:
        _, _, off = self._info(name)
        if off + rows * row_bytes > len(self.map):
            raise Unsupported(f"cannot read GGUF {self.path}: tensor {name} ends past the end of the file (truncated?)")
        with warnings.catch_warnings():  # a read-only memory map: the kernels never write to it
            warnings.simplefilter("ignore", UserWarning)
            return torch.from_numpy(self.map[off: off + rows * row_bytes].reshape(rows, row_bytes))

    def qtensor(self, name: str) -> QTensor:
        dims, fmt, _ = self._info(name)
        if len(dims) != 2:
            raise Unsupported(f"tensor {name} is not a matrix")
        k, n = int(dims[0]), int(dims[1])
        check_format(name, fmt, k)
        rb = formats.of(fmt).row_bytes(k)
        return QTensor(fmt, self._bytes(name, n, rb), n, k, mapped=True)

    def vector(self, name: str) -> torch.Tensor:
        dims, fmt, _ = self._info(name)
        if fmt not in FLOAT_DTYPE or len(dims) != 1:
            raise Unsupported(f"tensor {name} is not a float vector")
        n = int(dims[0])
        return self._bytes(name, 1, n * FLOAT_BYTES[fmt]).clone().view(FLOAT_DTYPE[fmt]).reshape(-1).float()


def _string(buf, pos):
    (n,) = struct.unpack_from("<Q", buf, pos)
    return bytes(buf[pos + 8: pos + 8 + n]).decode("utf-8"), pos + 8 + n


def _value(buf, pos, vtype):
    if vtype in _SCALARS:
        return struct.unpack_from(_SCALARS[vtype], buf, pos)[0], pos + struct.calcsize(_SCALARS[vtype])
    if vtype == _STRING:
        return _string(buf, pos)
    if vtype == _ARRAY:  # skipped (tokenizer vocabularies): the tokenizer is read by transformers, once
        etype, count = struct.unpack_from("<IQ", buf, pos)
        pos += 12
        if etype == _ARRAY:  # arrays of arrays: no key the runtime reads has them, and their depth is unbounded
            raise ValueError("nested metadata arrays are not supported")
        if etype in _SCALARS:
            return None, pos + count * struct.calcsize(_SCALARS[etype])
        if etype == _STRING:  # only the lengths are read (a 152k vocabulary and its merges: 0.36 -> 0.07 s)
            length = struct.Struct("<Q").unpack_from
            for _ in range(count):
                pos += 8 + length(buf, pos)[0]
            if pos > len(buf):
                raise ValueError("a string array runs past the end of the file")
            return None, pos
        for _ in range(count):
            _, pos = _value(buf, pos, etype)
        return None, pos
    raise ValueError(f"unknown GGUF value type {vtype}")


# ---- safetensors directories -----------------------------------------------------------------------------------
class SafetensorsDir:
    """The tensors of a Hugging Face model directory, each in its own dtype (fp32, fp16 or bf16)."""

    def __init__(self, path):
        from safetensors import safe_open
        files = sorted(path.glob("*.safetensors"))
        if not files:
            raise Unsupported(f"{path} has no .safetensors weights")
        self.handles, self.where = [], {}
        for f in files:
            h = safe_open(str(f), framework="pt")
            self.handles.append(h)
            for name in h.keys():
                self.where[name] = h

    def has(self, name: str) -> bool:
        return name in self.where

    def tensor(self, name: str) -> torch.Tensor:
        return self.where[name].get_tensor(name)

    def qtensor(self, name: str) -> QTensor:
        w = self.tensor(name)
        if w.dtype not in kernels.TORCH_FORMAT:
            raise Unsupported(f"tensor {name} is {w.dtype}; the runtime runs fp32, fp16 and bf16 safetensors")
        return QTensor.from_float(w)

    def vector(self, name: str) -> torch.Tensor:
        return self.tensor(name).float().contiguous()
