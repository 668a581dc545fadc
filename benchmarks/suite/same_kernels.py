"""The kernels of a git revision against the working tree's, on one model, in ONE interleaved run: every pass's
logits compared bitwise (prefill, a one-token step, an 8-row verify pass, a tree pass; exact and q8; both
instruction sets), then the pass curve (1..8 rows after a cached prompt; q8, or --numerics exact) timed
alternately, medians over rounds.
For refactors that must not change the library (a split that only moves code gives the same bits, at the same speed).

    python benchmarks/runtime.py same-kernels [--against REV] [--model default|FILE.gguf] [--rounds 7] [--numerics q8|exact] [--json out.json]

An older revision's build may lack entry points the current loader checks (rows_formats): they are added from a
shim generated from kernels/formats.py, so that its bits can be loaded and compared at all.
"""
from __future__ import annotations

import argparse
import ctypes
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ["SPECDEC_Q8_CACHE"] = "0"  # two libraries, two layouts: keep neither in the user's cache

import torch  # noqa: E402

from specdec import kernels, models  # noqa: E402
from specdec.kernels import formats  # noqa: E402
from specdec.runtime.load import load_gguf  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
KERNELS = "specdec/kernels"


def sources_at(rev: str, into: Path) -> Path:
    """rows.cpp and its headers as of `rev`, written under `into`; the path of its rows.cpp."""
    names = subprocess.run(["git", "ls-tree", "--name-only", f"{rev}:{KERNELS}"], cwd=ROOT, check=True,
                           capture_output=True, text=True).stdout.split()
    for name in names:
        if name.endswith((".cpp", ".h")):
            blob = subprocess.run(["git", "show", f"{rev}:{KERNELS}/{name}"], cwd=ROOT, check=True,
                                  capture_output=True).stdout
            (into / name).write_bytes(blob)
    shim = "\n".join(f"    {f.id}, {f.block}, {f.bytes}, {f.q8}," for f in formats.TABLE)
    text = (into / "rows.cpp").read_text()
    if "rows_formats" not in text:  # an older build: the loader's format check, answered from today's table
        (into / "rows.cpp").write_text(text + "\nextern \"C\" int rows_formats(long* out, int cap) {\n"
                                       f"    static const long t[] = {{\n{shim}\n    }};\n"
                                       "    const int n = (int)(sizeof(t) / sizeof(t[0]));\n"
                                       "    for (int i = 0; i < n && i < cap; i++) out[i] = t[i];\n    return n;\n}\n")
    return into / "rows.cpp"


def build(source: Path, isa: str, into: Path) -> kernels.Library:
    compiler = os.environ.get("CXX", "g++")
    out = into / f"rows-{isa}-{source.parent.name}.so"
    subprocess.run([compiler, *kernels.COMMON, *kernels.ISA_FLAGS[isa], str(source), "-o", str(out)], check=True,
                   capture_output=True, timeout=600)
    strict = formats.check
    formats.check = same_blocks  # the layout a format runs as in q8 is each build's own (Q5_0's changed)
    try:
        return kernels.Library(out, isa)
    finally:
        formats.check = strict


def same_blocks(rows_formats) -> None:
    """formats.check without the q8 layout column: the same formats with the same blocks, however each runs."""
    buf = (ctypes.c_long * 256)()
    n = rows_formats(buf, 256)
    theirs = [tuple(buf[i: i + 3]) for i in range(0, min(n, 256), 4)]
    if theirs != [(f.id, f.block, f.bytes) for f in formats.TABLE]:
        raise SystemExit(f"same_kernels: the builds disagree on the formats themselves ({theirs})")


def with_library(lib: kernels.Library, path: Path, numerics: str):
    """The model loaded with `lib` as its kernels (every caller of kernels.library() gets it)."""
    kernels.library = lambda isa=None: lib
    model = load_gguf(path)
    model.set_numerics(numerics)
    return model


@torch.inference_mode()
def passes(model, prompt: list[int]) -> list[torch.Tensor]:
    """The logits of: the prompt's prefill (every row), one step, an 8-row verify pass, a 6-node tree pass."""
    cache = model.new_cache()
    out = [cache.forward(prompt, n_logits=len(prompt))]
    out.append(cache.forward(prompt + [11], n_logits=1))
    verify = prompt + [11, 12, 13, 14, 15, 16, 17, 18, 19]
    out.append(cache.forward(verify, n_logits=8))
    out.append(cache.forward_tree(verify, [21, 22, 23, 24, 25, 26], [-1, 0, 0, 1, 3, -1]))
    cache.close()
    return out


@torch.inference_mode()
def curve(model, prompt: list[int], sizes=range(1, 9)) -> dict[int, float]:
    """Seconds of one pass over r new rows after the cached prompt, for each r (after one untimed pass)."""
    cache = model.new_cache()
    cache.forward(prompt)
    out = {}
    for r in sizes:
        tokens = prompt + list(range(100, 100 + r))
        cache.forward(tokens, n_logits=r)
        cache.rollback(len(prompt))
        t = time.perf_counter()
        cache.forward(tokens, n_logits=r)
        out[r] = time.perf_counter() - t
        cache.rollback(len(prompt))
    cache.close()
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--against", default="HEAD", help="the git revision whose kernels are compared (default HEAD)")
    ap.add_argument("--model", default="default")
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--numerics", default="q8", choices=("exact", "q8"), help="the pass curve's mode (default q8)")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    path = models.resolve(args.model)
    isas = ["avx512", "avx2"] if kernels.best_isa() == "avx512" else ["avx2"]
    tmp = Path(tempfile.mkdtemp(prefix="specdec-same-kernels-"))
    (tmp / "then").mkdir()
    try:
        then_src, now_src = sources_at(args.against, tmp / "then"), kernels.SOURCE
    except subprocess.CalledProcessError:
        print(f"same_kernels: no kernels at revision {args.against!r} of this checkout", file=sys.stderr)
        return 2
    if kernels.library() is None:
        print("same_kernels: this machine builds no CPU kernels (no AVX2, or no C++ compiler)", file=sys.stderr)
        return 2
    prompt = list(range(1000, 1040))
    report = {"against": args.against, "model": str(path), "numerics": args.numerics, "bitwise": {}, "curve_ms": {}}
    for isa in isas:
        libs = {"then": build(then_src, isa, tmp), "now": build(now_src, isa, tmp)}
        for numerics in ("exact", "q8"):
            got = {name: passes(with_library(lib, path, numerics), prompt) for name, lib in libs.items()}
            same = all(torch.equal(a, b) for a, b in zip(got["then"], got["now"]))
            report["bitwise"][f"{isa}/{numerics}"] = same
            print(f"{isa:6s} {numerics:5s}: {'bitwise equal' if same else 'DIFFERENT'} over "
                  f"{sum(len(t) for t in got['now'])} logit rows", flush=True)
    isa = isas[0]
    libs = {"then": build(then_src, isa, tmp), "now": build(now_src, isa, tmp)}
    loaded = {name: with_library(lib, path, args.numerics) for name, lib in libs.items()}
    times: dict[str, dict[int, list[float]]] = {name: {} for name in libs}
    for _ in range(args.rounds):  # rounds alternate the two libraries
        for name, model in loaded.items():
            kernels.library = lambda isa=None, lib=libs[name]: lib
            for r, s in curve(model, prompt).items():
                times[name].setdefault(r, []).append(s)
    print(f"{args.numerics} pass curve ({isa}, medians of {args.rounds} alternating rounds), ms by rows:")
    for name in libs:
        med = {r: statistics.median(v) * 1e3 for r, v in times[name].items()}
        report["curve_ms"][name] = med
        print(f"  {name:4s} " + "  ".join(f"{r}:{m:6.2f}" for r, m in med.items()))
    ratio = {r: report["curve_ms"]["now"][r] / report["curve_ms"]["then"][r] for r in times["now"]}
    report["now_over_then"] = ratio
    print("  now/then " + "  ".join(f"{r}:{q:.3f}" for r, q in ratio.items()))
    if args.json:
        args.json.write_text(json.dumps(report, indent=1) + "\n")
    return 0 if all(report["bitwise"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
