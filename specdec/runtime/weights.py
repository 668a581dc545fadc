"""Weights in their file's form: GGUF tensors memory-mapped through the `gguf` package's reader (quantized blocks
never expanded), safetensors tensors in their own dtype. A linear's weight is a QTensor: n rows of k columns in one
format; the kernels read it as it is, and `dequantize` gives exactly gguf's reference values (torch fallback)."""
from __future__ import annotations

import warnings
from dataclasses import dataclass, field

import numpy as np
import torch
from torch.nn import functional as F

from .. import kernels

GGML_BLOCK = {kernels.Q4_0: (32, 18), kernels.Q4_1: (32, 20), kernels.Q8_0: (32, 34)}  # columns, bytes per block
FLOAT_BYTES = {kernels.F32: 4, kernels.F16: 2, kernels.BF16: 2}
FLOAT_DTYPE = {kernels.F32: torch.float32, kernels.F16: torch.float16, kernels.BF16: torch.bfloat16}


class Unsupported(ValueError):
    """A file or architecture the runtime does not run (the transformers backend may)."""


@dataclass(eq=False)
class QTensor:
    """n rows of k columns in ggml format `fmt`: `data` is [n, row bytes] uint8 (a view of the file where possible)."""
    fmt: int
    data: torch.Tensor
    n: int
    k: int
    scales: torch.Tensor | None = field(default=None, repr=False)  # block formats: fp32 d (and m), see scales_of
    _dense: torch.Tensor | None = field(default=None, repr=False)

    def __post_init__(self):
        if self.fmt in GGML_BLOCK and self.scales is None:
            self.scales = scales_of(self.fmt, self.data)

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
        """A copy of some rows (e.g. Q/K rows reordered, or the head rows of a reduced vocabulary)."""
        rows = torch.as_tensor(rows, dtype=torch.long)
        return QTensor(self.fmt, self.data[rows].contiguous(), len(rows), self.k)

    def rows(self, idx) -> torch.Tensor:
        """Rows `idx` dequantized to fp32 [len(idx), k] (embedding lookups)."""
        return _dequantize(self.fmt, self.data[torch.as_tensor(idx, dtype=torch.long)], self.k)

    def dequantize(self) -> torch.Tensor:
        """All rows in fp32, exactly as gguf's reference dequantizes them (cached: torch fallback and tests)."""
        if self._dense is None:
            self._dense = _dequantize(self.fmt, self.data, self.k)
        return self._dense


def scales_of(fmt: int, data: torch.Tensor) -> torch.Tensor:
    """The blocks' fp16 scales widened to fp32 (exact), [n, blocks] d or [n, blocks, 2] d and m (Q4_1): the kernels
    broadcast them from memory instead of converting one per block. 4-8 bytes per 32 weights; the blocks stay."""
    cols, nbytes = GGML_BLOCK[fmt]
    blocks = data.view(data.shape[0], -1, nbytes)
    halves = blocks[..., : 4 if fmt == kernels.Q4_1 else 2].contiguous().view(torch.float16)
    return halves.float().contiguous()


def _dequantize(fmt: int, data: torch.Tensor, k: int) -> torch.Tensor:
    if fmt in FLOAT_DTYPE:
        return data.contiguous().view(FLOAT_DTYPE[fmt]).reshape(-1, k).float()
    import gguf
    out = gguf.quants.dequantize(data.numpy(), gguf.GGMLQuantizationType(fmt))
    return torch.from_numpy(np.ascontiguousarray(out, dtype=np.float32)).reshape(-1, k)


def qlinear(x: torch.Tensor, w: QTensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x·Wᵀ (+ b): the kernel on W's own blocks where it runs, else torch on the same dequantized values."""
    if kernels.library() is not None:
        return kernels.linear(w.fmt, x, w.data, w.n, bias, w.scales)
    return F.linear(x, w.dequantize(), bias)


def check_format(name: str, fmt: int, k: int) -> None:
    if fmt in FLOAT_BYTES:
        return
    if fmt not in GGML_BLOCK:
        import gguf
        try:
            tname = gguf.GGMLQuantizationType(fmt).name
        except ValueError:
            tname = str(fmt)
        raise Unsupported(f"tensor {name} is {tname}; the runtime runs F32, F16, BF16, Q4_0, Q4_1 and Q8_0")
    if k % GGML_BLOCK[fmt][0]:
        raise Unsupported(f"tensor {name} has {k} columns, not a whole number of blocks")


# ---- GGUF ------------------------------------------------------------------------------------------------------
class GGUFFile:
    """Metadata and tensors of a GGUF file, memory-mapped (nothing is read until a kernel touches it)."""

    def __init__(self, path):
        import gguf
        try:
            self.reader = gguf.GGUFReader(path, "r")
        except (ValueError, OSError, KeyError) as e:
            raise Unsupported(f"cannot read GGUF {path}: {e}")
        self.tensors = {t.name: t for t in self.reader.tensors}

    def meta(self, key: str, default=None):
        f = self.reader.fields.get(key)
        if f is None:
            return default
        v = f.contents()
        return v

    def has(self, name: str) -> bool:
        return name in self.tensors

    def qtensor(self, name: str) -> QTensor:
        t = self.tensors[name]
        if len(t.shape) != 2:
            raise Unsupported(f"tensor {name} is not a matrix")
        k, n, fmt = int(t.shape[0]), int(t.shape[1]), int(t.tensor_type)
        check_format(name, fmt, k)
        with warnings.catch_warnings():  # a read-only memory map: the kernels never write to it
            warnings.simplefilter("ignore", UserWarning)
            data = torch.from_numpy(np.asarray(t.data).view(np.uint8).reshape(n, -1))
        return QTensor(fmt, data, n, k)

    def vector(self, name: str) -> torch.Tensor:
        t = self.tensors[name]
        fmt = int(t.tensor_type)
        if fmt not in FLOAT_DTYPE:
            raise Unsupported(f"tensor {name} is not a float vector")
        return torch.from_numpy(np.array(t.data)).view(FLOAT_DTYPE[fmt]).reshape(-1).float().contiguous()


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
