"""The C structs rows.cpp's entry points take, mirrored in ctypes, and checked against the library when it loads:
rows.cpp exports each struct's size and field offsets (`rows_abi`), so a field added on one side only is an error
at load, never memory read at the wrong place."""
from __future__ import annotations

import ctypes

_p, _i, _f = ctypes.c_void_p, ctypes.c_int, ctypes.c_float


class Seg(ctypes.Structure):
    """One weight matrix of a fused linear: its blocks, its q8 layout (or null), its bias, format and rows."""
    _fields_ = [("w", _p), ("wq", _p), ("bias", _p), ("fmt", _i), ("n", _i)]


class Lin(ctypes.Structure):
    _fields_ = [("seg", Seg * 3), ("count", _i)]


class Layer(ctypes.Structure):
    _fields_ = [("attn_norm", _p), ("qkv", Lin), ("o", Lin), ("ffn_norm", _p), ("gate_up", Lin), ("down", Lin),
                ("q_norm", _p), ("k_norm", _p), ("post_attn_norm", _p), ("post_ffn_norm", _p), ("cos", _p),
                ("sin", _p), ("window", _i)]


class Dims(ctypes.Structure):
    _fields_ = [("hidden", _i), ("heads", _i), ("kv_heads", _i), ("head_dim", _i), ("inter", _i), ("layers", _i),
                ("max_len", _i), ("interleaved", _i), ("eps", _f), ("cos", _p), ("sin", _p), ("kpool", _p),
                ("vpool", _p), ("tables", _p), ("blocks", _i), ("q8", _i), ("kv16", _i), ("act", _i),
                ("attn_scale", _f)]


STRUCTS = (Seg, Lin, Layer, Dims)  # rows_abi's order


class AbiMismatch(RuntimeError):
    """The compiled kernels and these mirrors disagree: calling them would read memory at the wrong places."""


def layout(structs=STRUCTS) -> list[int]:
    """Each struct's size, then its fields' offsets, as rows_abi writes them."""
    out = []
    for cls in structs:
        out += [ctypes.sizeof(cls)] + [getattr(cls, name).offset for name, _ in cls._fields_]
    return out


def check(rows_abi, structs=STRUCTS) -> None:
    """AbiMismatch naming the first struct that differs."""
    buf = (ctypes.c_long * 256)()
    n = rows_abi(buf, 256)
    theirs, ours = list(buf[:n]), layout(structs)
    if theirs == ours:
        return
    at = 0
    for cls in structs:
        width = 1 + len(cls._fields_)
        if theirs[at: at + width] != ours[at: at + width]:
            raise AbiMismatch(f"specdec's kernels and their ctypes mirrors disagree on struct {cls.__name__} "
                              f"(C++ size and offsets {theirs[at: at + width]}, Python {ours[at: at + width]}): "
                              "update kernels/abi.py with rows.cpp")
        at += width
    raise AbiMismatch(f"specdec's kernels export {n} ABI values, the mirrors describe {len(ours)}")
