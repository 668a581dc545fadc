"""The package's import graph, read from the source (function-local imports included, annotation-only ones under
TYPE_CHECKING left out): no cycles, and the runtime and kernels import nothing above them."""
import ast
from pathlib import Path

import specdec

ROOT = Path(specdec.__file__).parent
BELOW_ALL = ("specdec.kernels", "specdec.runtime", "specdec.cachedir", "specdec.errors")  # what they may import


def modules() -> dict[str, Path]:
    out = {}
    for f in ROOT.rglob("*.py"):
        parts = ["specdec", *f.relative_to(ROOT).with_suffix("").parts]
        out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = f
    return out


def imports(name: str, path: Path, known: dict) -> set[str]:
    """The package modules `name` imports anywhere in its source, but under `if TYPE_CHECKING:`."""
    tree = ast.parse(path.read_text())
    typing_only = {id(n) for b in ast.walk(tree) if isinstance(b, ast.If) and "TYPE_CHECKING" in ast.unparse(b.test)
                   for n in ast.walk(b)}
    package = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
    out = set()
    for node in ast.walk(tree):
        if id(node) in typing_only:
            continue
        if isinstance(node, ast.ImportFrom):
            base = package[:len(package) - node.level + 1] if node.level else []
            mod = ".".join(base + (node.module.split(".") if node.module else []))
            out |= {f"{mod}.{a.name}" if f"{mod}.{a.name}" in known else mod for a in node.names}
        elif isinstance(node, ast.Import):
            out |= {a.name for a in node.names}
    return {m for m in out if m in known and m != name and not name.startswith(m + ".")}


def graph() -> dict[str, set[str]]:
    known = modules()
    return {name: imports(name, path, known) for name, path in known.items()}


def cycles(g: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index, low, stack, on, found, counter = {}, {}, [], set(), [], [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in g[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                found.append(sorted(comp))
    for v in g:
        if v not in index:
            visit(v)
    return found


def test_the_package_has_no_import_cycles():
    g = graph()
    assert len(g) > 50 and g["specdec.engine"]  # the graph is read, not empty
    assert cycles(g) == []


def test_the_cycle_finder_finds_a_cycle():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_the_runtime_and_kernels_import_nothing_above_them():
    for name, deps in graph().items():
        if name.startswith(("specdec.runtime", "specdec.kernels")):
            above = sorted(d for d in deps if not d.startswith(BELOW_ALL))
            assert not above, f"{name} imports {above}"


def test_the_kernels_structs_are_checked_against_their_mirrors():
    """rows.cpp exports each struct's size and field offsets; the library loads only if kernels/abi.py agrees, and a
    field on one side only is refused by name."""
    import ctypes

    import pytest

    from specdec import kernels
    from specdec.kernels import abi
    lib = kernels.library()
    if lib is None:
        pytest.skip("no CPU kernels here")
    rows_abi = ctypes.CDLL(str(lib.path)).rows_abi
    rows_abi.argtypes, rows_abi.restype = [ctypes.c_void_p, ctypes.c_int], ctypes.c_int
    abi.check(rows_abi)  # the real build agrees

    class Layer(ctypes.Structure):  # a mirror that lost a field
        _fields_ = [f for f in abi.Layer._fields_ if f[0] != "post_ffn_norm"]
    with pytest.raises(abi.AbiMismatch, match="struct Layer"):
        abi.check(rows_abi, (abi.Seg, abi.Lin, Layer, abi.Dims))


def test_the_format_table_is_one_fact_checked_against_the_library():
    """formats.TABLE equals rows.cpp's FORMAT_TABLE (checked at load); a table that drifts is refused, and a format
    neither knows is an error, never another format's arithmetic."""
    import ctypes

    import pytest
    import torch

    from specdec import kernels
    from specdec.kernels import abi, formats
    from specdec.runtime import weights
    lib = kernels.library()
    if lib is None:
        pytest.skip("no CPU kernels here")
    rows_formats = ctypes.CDLL(str(lib.path)).rows_formats
    rows_formats.argtypes, rows_formats.restype = [ctypes.c_void_p, ctypes.c_int], ctypes.c_int
    formats.check(rows_formats)
    drifted = formats.TABLE[:-1] + (formats.Format(formats.Q6_K, "Q6_K", 256, 208, formats.Q6_K),)
    monkey = pytest.MonkeyPatch()
    monkey.setattr(formats, "TABLE", drifted)
    try:
        with pytest.raises(abi.AbiMismatch, match="format table"):
            formats.check(rows_formats)
    finally:
        monkey.undo()
    for f in formats.TABLE:  # row bytes: the library's and the runtime's are the table's
        for k in (0, 32, 256, 512, 48):
            assert lib.row_bytes(f.id, k) == f.row_bytes(k)
            if not f.is_float:
                assert weights.GGML_BLOCK[f.id] == (f.block, f.bytes)
        assert kernels.q8_format(f.id) == (f.q8 != 0)
    x, unknown = torch.randn(2, 32), 9  # ggml's Q8_1: not a format the kernels serve
    assert lib.row_bytes(unknown, 32) == -1 and not kernels.q8_format(unknown)
    with pytest.raises(ValueError, match="not 3 contiguous rows"):
        kernels.linear(unknown, x, torch.zeros(3, 34, dtype=torch.uint8), 3)
    with pytest.raises(formats.UnknownFormat, match="ggml type 9"):
        formats.of(unknown)


def test_the_build_covers_every_header_and_an_installed_copy_ships_them(monkeypatch, tmp_path, capsys):
    """The cache key hashes rows.cpp and every header it includes; the package data ships them all; a copy that
    lacks a header turns the kernels off with one line, never a silent build of a partial source."""
    import fnmatch
    import shutil
    import tomllib


    from specdec import kernels
    headers = kernels.headers()
    assert len(headers) >= 10 and all((kernels.SOURCE.parent / h).is_file() for h in headers)
    on_disk = {p.name for p in kernels.SOURCE.parent.glob("*.h")}
    assert on_disk == set(headers), "a header rows.cpp does not include, or one it includes that is missing"
    data = tomllib.loads((ROOT.parent / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]["specdec"]
    for name in ["rows.cpp", *headers]:
        assert any(fnmatch.fnmatch(f"kernels/{name}", pattern) for pattern in data), f"{name} is not package data"
    copy = tmp_path / "kernels"
    shutil.copytree(kernels.SOURCE.parent, copy, ignore=shutil.ignore_patterns("__pycache__"))
    monkeypatch.setattr(kernels, "SOURCE", copy / "rows.cpp")
    before = kernels._sources()
    (copy / "attention.h").write_text((copy / "attention.h").read_text() + "\n// an edit\n")
    assert kernels._sources() != before  # a header's edit is a new build
    if kernels.best_isa() is None:
        return
    (copy / "layer.h").unlink()
    monkeypatch.setenv("SPECDEC_CACHE", str(tmp_path / "cache"))
    kernels.library.cache_clear()
    try:
        assert kernels.library() is None
        err = capsys.readouterr().err.strip()
        assert "CPU kernel unavailable" in err and "layer.h" in err and "\n" not in err
    finally:
        kernels.library.cache_clear()
