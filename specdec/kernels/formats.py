"""The weight formats the kernels serve, one row each: ggml's type id, name, columns and bytes per block, and the
layout the q8 mode repacks it into (0: exact kernels only). rows.cpp's FORMAT_TABLE (formats.h) is the same table;
`check` compares the two when the library loads, so the C++ and Python sides cannot drift. Everything else (row
bytes, which formats q8 serves, the runtime's block sizes) is read from here."""
from __future__ import annotations

import ctypes
from dataclasses import dataclass

from .abi import AbiMismatch


@dataclass(frozen=True)
class Format:
    id: int
    name: str
    block: int  # columns per block (1: a float format)
    bytes: int  # bytes per block
    q8: int  # the type id whose q8 layout it is repacked into; 0: none

    @property
    def is_float(self) -> bool:
        return self.block == 1

    def row_bytes(self, k: int) -> int:
        """Bytes of one row of k columns, or -1 where k is not a whole number of blocks."""
        return -1 if k < 0 or k % self.block else self.bytes * (k // self.block)


F32, F16, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, BF16 = 0, 1, 2, 3, 6, 7, 8, 30
Q2_K, Q3_K, Q4_K, Q5_K, Q6_K = 10, 11, 12, 13, 14
TABLE = (
    Format(F32, "F32", 1, 4, 0), Format(F16, "F16", 1, 2, 0), Format(BF16, "BF16", 1, 2, 0),
    Format(Q4_0, "Q4_0", 32, 18, Q4_0), Format(Q4_1, "Q4_1", 32, 20, Q4_1), Format(Q5_0, "Q5_0", 32, 22, Q5_0),
    Format(Q5_1, "Q5_1", 32, 24, Q5_K), Format(Q8_0, "Q8_0", 32, 34, Q8_0), Format(Q2_K, "Q2_K", 256, 84, Q2_K),
    Format(Q3_K, "Q3_K", 256, 110, Q3_K), Format(Q4_K, "Q4_K", 256, 144, Q4_K), Format(Q5_K, "Q5_K", 256, 176, Q5_K),
    Format(Q6_K, "Q6_K", 256, 210, Q6_K),
)
BY_ID = {f.id: f for f in TABLE}
NAMES = {f.id: f.name for f in TABLE}


class UnknownFormat(ValueError):
    """A ggml type id the kernels do not serve."""


def of(fmt: int) -> Format:
    try:
        return BY_ID[fmt]
    except KeyError:
        raise UnknownFormat(f"ggml type {fmt} is not a format specdec's kernels serve "
                            f"({', '.join(f.name for f in TABLE)})") from None


def check(rows_formats) -> None:
    """AbiMismatch unless the library's FORMAT_TABLE equals TABLE, row for row."""
    buf = (ctypes.c_long * 256)()
    n = rows_formats(buf, 256)
    theirs = [tuple(buf[i: i + 4]) for i in range(0, min(n, 256), 4)]
    ours = [(f.id, f.block, f.bytes, f.q8) for f in TABLE]
    if theirs != ours:
        raise AbiMismatch(f"specdec's kernels and kernels/formats.py disagree on the format table (C++ {theirs}, "
                          f"Python {ours}): update formats.py with formats.h")
