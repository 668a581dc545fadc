"""The compute floor of a q8 verify pass: how many 64-lane `vpdpbusd` this CPU retires per second and core (12
independent chains, the x bytes broadcast from memory as the q8 kernel does), and what n rows of a model's weights
cost at that rate (each weight is one multiply-add per row; a VNNI instruction does 64).

`--mix`: also the rate of 8 `vpdpbusd` beside the other work of a q8 tile's block and row (kernels/q8_linear.h: a
convert, a multiply and two fused multiply-adds), and beside one integer multiply (`vpmulld`, `vpdpwssd`) or one
convert alone, all from registers: where these share the vector issue slots, the tile's float scaling caps its rate.

    python benchmarks/runtime.py vnni-peak --params 1.54e9 --rows 1,4,8,16 [--mix]
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
from contextlib import contextmanager
from pathlib import Path

SOURCE = r"""
#include <immintrin.h>
#include <chrono>
#include <cstdio>
alignas(64) static int xs[64];
int main() {
    __m512i a[12];
    for (int i = 0; i < 12; i++) a[i] = _mm512_set1_epi32(i);
    __m512i w = _mm512_set1_epi8(3);
    const int* x = xs;
    const long n = 100000000;
    auto t0 = std::chrono::steady_clock::now();
    for (long k = 0; k < n; k++) {
#define D(i) a[i] = _mm512_dpbusd_epi32(a[i], w, _mm512_set1_epi32(x[i]));
        D(0) D(1) D(2) D(3) D(4) D(5) D(6) D(7) D(8) D(9) D(10) D(11)
        __asm__ volatile("" : "+r"(x));
    }
    const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    int r = 0;
    for (int i = 0; i < 12; i++) r += _mm512_reduce_add_epi32(a[i]);
    printf("%.4g %d\n", 12.0 * n / s, r & 1);
}
"""


MIX_SOURCE = r"""
#include <immintrin.h>
#include <chrono>
#include <cstdio>
#define R8(X) X(0) X(1) X(2) X(3) X(4) X(5) X(6) X(7)
#define R12(X) R8(X) X(8) X(9) X(10) X(11)
int main() {
#define DECL(i) __m512i a##i = _mm512_set1_epi32(i); __m512 f##i = _mm512_set1_ps(i);
    R12(DECL)
    __m512i w = _mm512_set1_epi8(3), x = _mm512_set1_epi8(5);
    __m512 fw = _mm512_set1_ps(1.0f), fx = _mm512_set1_ps(0.0f);
    const long n = 50000000;
    std::chrono::steady_clock::time_point t0;
#define D(i) a##i = _mm512_dpbusd_epi32(a##i, w, x);
#define F(i) f##i = _mm512_fmadd_ps(f##i, fw, fx);
#define KEEP __asm__ volatile("" : "+v"(w), "+v"(x), "+v"(fw), "+v"(fx), "+v"(a9));
#define RUN(name, per, body) t0 = std::chrono::steady_clock::now(); \
    for (long k = 0; k < n; k++) { body KEEP } \
    printf("%s %.4g\n", name, per * n / std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
    RUN("vpdpbusd_x12", 12.0, R12(D))
    RUN("fma_x12", 12.0, R12(F))
    RUN("vpdpbusd_x8+tile_scaling", 8.0, R8(D) f0 = _mm512_cvtepi32_ps(a9); f1 = _mm512_mul_ps(f1, fw); F(2) F(3))
    RUN("vpdpbusd_x8+vpmulld", 8.0, R8(D) a8 = _mm512_add_epi32(a8, _mm512_mullo_epi32(a9, w));)
    RUN("vpdpbusd_x8+vpdpwssd", 8.0, R8(D) a8 = _mm512_dpwssd_epi32(a8, a9, w);)
    RUN("vpdpbusd_x8+convert", 8.0, R8(D) f0 = _mm512_cvtepi32_ps(a9);)
    int r = 0;
#define SUM(i) r += _mm512_reduce_add_epi32(a##i) + (int)_mm512_reduce_add_ps(f##i);
    R12(SUM)
    printf("check %d\n", r & 1);
}
"""


@contextmanager
def compiled(source: str):
    """The path of `source` built with AVX-512 VNNI and FMA, in a directory removed afterwards."""
    compiler = shutil.which(os.environ.get("CXX", "g++"))
    if compiler is None:
        raise SystemExit("vnni_peak: needs a C++ compiler (g++)")
    with tempfile.TemporaryDirectory() as tmp:
        src, exe = Path(tmp) / "loop.cpp", Path(tmp) / "loop"
        src.write_text(source)
        subprocess.run([compiler, "-O2", "-mavx512f", "-mavx512bw", "-mavx512vnni", "-mfma", str(src), "-o", str(exe)],
                       check=True, capture_output=True)
        yield str(exe)


def mix_per_second() -> dict[str, float]:
    """Instructions a second on one core for each MIX_SOURCE loop (vpdpbusd a second, or FMA for fma_x12)."""
    with compiled(MIX_SOURCE) as exe:
        lines = subprocess.run([exe], check=True, capture_output=True, text=True).stdout.split("\n")
    return {k: float(v) for k, v in (line.split() for line in lines if line and not line.startswith("check"))}


def vnni_per_second(threads: int) -> float:
    """vpdpbusd zmm per second on one core, the best of `threads` copies run at once (all cores busy, as a pass)."""
    with compiled(SOURCE) as exe:
        procs = [subprocess.Popen([exe], stdout=subprocess.PIPE, text=True) for _ in range(threads)]
        rates = [float(p.communicate()[0].split()[0]) for p in procs]
    return min(rates)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--params", type=float, default=1.54e9, help="weights a pass multiplies (default: the 1.5B)")
    ap.add_argument("--rows", default="1,4,8,16")
    ap.add_argument("--threads", type=int, default=os.cpu_count())
    ap.add_argument("--mix", action="store_true", help="also the rates beside a tile's other vector work")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    if "avx512_vnni" not in Path("/proc/cpuinfo").read_text():
        print("vnni_peak: this CPU has no AVX-512 VNNI", file=sys.stderr)
        return 2
    rate = vnni_per_second(args.threads)
    floor = {int(n): round(1e3 * args.params * int(n) / 64 / (rate * args.threads), 2) for n in args.rows.split(",")}
    report = {"vpdpbusd_per_s_per_core": rate, "cores": args.threads, "params": args.params,
              "compute_floor_ms": floor}
    if args.mix:
        report["one_core_from_registers_per_s"] = mix_per_second()
    text = json.dumps(report, indent=1)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
