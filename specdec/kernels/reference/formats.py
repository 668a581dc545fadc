"""formats.h's blocks as the exact kernels widen them: gguf's reference dequantization (each format's d·q (+ m)
in fp32), which the exact linear then multiplies in fp32. Float formats are widened exactly."""
from __future__ import annotations

import numpy as np

from .. import formats

F32 = np.float32
_FLOAT = {formats.F32: np.float32, formats.F16: np.float16}


def dequantize(fmt: int, data: np.ndarray, n: int, k: int) -> np.ndarray:
    """n rows of k columns in format `fmt` (their bytes, [n, row bytes] uint8) -> fp32 [n, k]."""
    data = np.ascontiguousarray(data, np.uint8).reshape(n, -1)
    if fmt == formats.BF16:  # the top half of an fp32
        return (data.view(np.uint16).astype(np.uint32) << 16).view(F32).reshape(n, k)
    if fmt in _FLOAT:
        return data.view(_FLOAT[fmt]).astype(F32).reshape(n, k)
    import gguf
    formats.of(fmt)  # UnknownFormat for a type the kernels do not serve
    return np.ascontiguousarray(gguf.quants.dequantize(data, gguf.GGMLQuantizationType(fmt)), F32).reshape(n, k)
