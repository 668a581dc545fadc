"""A draft model's 4-bit copy: the same GGUF with every matrix wider than 5 bits a weight requantized to 4 bits.

A draft's step reads its weights once per token, so its cost is its bytes: the pair's 0.5B draft (Q4_K_M: Q5_0
matrices, a Q8_0 head) reads 310 MB a step, its 4-bit copy 235 MB, and runs 1.10x as fast over the pair's prompts
with nearly the same tokens a pass (CHANGELOG.md, "A draft model runs as its 4-bit copy"). Nothing a draft
computes changes the output: verification keeps only what the target itself would emit. So a GGUF draft model runs as this copy, made once and kept in

    $SPECDEC_CACHE/drafts4/<file stem>-<sha256 of the file, 16 hex>-v<RECIPE>.gguf

(`keep:FILE` runs the file as it is). Matrices of a multiple of 256 columns become Q4_K, the others Q4_0 (4.5 bits
a weight each); 1-D tensors, and the token embedding where the file has its own head, stay as they are. The file
is written beside its final name and renamed into place."""
from __future__ import annotations

import os
import tempfile
from pathlib import Path

import numpy as np

from ..cachedir import cache_root, file_sha256
from ..kernels.formats import BF16, F16, F32, Q4_0, Q4_K, Q5_0, Q5_1, Q5_K, Q6_K, Q8_0
from .progress import Progress
from .quantize import quantize

RECIPE = 1  # part of the copy's name: a change to what is requantized, or how, makes new copies
WIDE = {F32, F16, BF16, Q8_0, Q6_K, Q5_1, Q5_0, Q5_K}  # more than 5 bits a weight


def four_bit_format(fmt: int, shape: tuple[int, ...]) -> int | None:
    """The 4-bit format a matrix [n, k] of type `fmt` is requantized to, or None (kept)."""
    if len(shape) != 2 or fmt not in WIDE:
        return None
    k = shape[1]
    return Q4_K if k % 256 == 0 else Q4_0 if k % 32 == 0 else None


def copy_path(path: Path) -> Path:
    return cache_root() / "drafts4" / f"{path.stem}-{file_sha256(path)[:16]}-v{RECIPE}.gguf"


def four_bit_copy(path: Path) -> Path:
    """The 4-bit copy of the GGUF at `path` (made on the first call), or `path` itself where no matrix is wider."""
    import gguf
    out = copy_path(Path(path))
    if out.is_file():
        return out
    reader = gguf.GGUFReader(path)
    names = {t.name for t in reader.tensors}
    plan = []
    for t in reader.tensors:
        shape = tuple(int(d) for d in reversed(t.shape))  # [n, k]: GGUF lists the columns first
        tied_head = t.name == "token_embd.weight" and "output.weight" not in names
        fmt = four_bit_format(int(t.tensor_type), shape) if t.name != "token_embd.weight" or tied_head else None
        plan.append((t, shape, fmt))
    if all(fmt is None for _, _, fmt in plan):
        return Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=out.parent, prefix=out.stem + ".", suffix=".part")
    os.close(fd)
    try:
        writer = gguf.GGUFWriter(tmp, reader.fields["general.architecture"].contents())
        for name, field in reader.fields.items():
            if name.startswith("GGUF.") or name in ("general.architecture", "general.alignment"):
                continue  # the writer's own
            kind = field.types[0]
            writer.add_key_value(name, field.contents(), kind,
                                 sub_type=field.types[-1] if kind == gguf.GGUFValueType.ARRAY else None)
        total = sum(int(t.n_bytes) for t, _, fmt in plan if fmt is not None)
        with Progress(f"a 4-bit copy of the draft {Path(path).name}", "requantizing", total, out.parent) as progress:
            for t, shape, fmt in plan:
                if fmt is None:
                    writer.add_tensor(t.name, np.asarray(t.data), raw_dtype=t.tensor_type)
                    continue
                weights = gguf.quants.dequantize(t.data, t.tensor_type).reshape(shape)
                writer.add_tensor(t.name, quantize(weights, fmt), raw_dtype=gguf.GGMLQuantizationType(fmt))
                progress.advance(int(t.n_bytes))
            writer.write_header_to_file()
            writer.write_kv_data_to_file()
            writer.write_tensors_to_file()
            writer.close()
        os.chmod(tmp, 0o644)
        os.replace(tmp, out)
    finally:
        Path(tmp).unlink(missing_ok=True)
    return out
