"""The compute floor of a q8 verify pass: how many 64-lane `vpdpbusd` this CPU retires per second and core (12
independent chains, the x bytes broadcast from memory as the q8 kernel does), and what n rows of a model's weights
cost at that rate (each weight is one multiply-add per row; a VNNI instruction does 64).

    python benchmarks/vnni_peak.py --params 1.54e9 --rows 1,4,8,16
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
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


def vnni_per_second(threads: int) -> float:
    """vpdpbusd zmm per second on one core, the best of `threads` copies run at once (all cores busy, as a pass)."""
    compiler = shutil.which(os.environ.get("CXX", "g++"))
    if compiler is None:
        raise SystemExit("vnni_peak: needs a C++ compiler (g++)")
    with tempfile.TemporaryDirectory() as tmp:
        src, exe = Path(tmp) / "peak.cpp", Path(tmp) / "peak"
        src.write_text(SOURCE)
        subprocess.run([compiler, "-O2", "-mavx512f", "-mavx512bw", "-mavx512vnni", str(src), "-o", str(exe)],
                       check=True, capture_output=True)
        procs = [subprocess.Popen([str(exe)], stdout=subprocess.PIPE, text=True) for _ in range(threads)]
        rates = [float(p.communicate()[0].split()[0]) for p in procs]
    return min(rates)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--params", type=float, default=1.54e9, help="weights a pass multiplies (default: the 1.5B)")
    ap.add_argument("--rows", default="1,4,8,16")
    ap.add_argument("--threads", type=int, default=os.cpu_count())
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    if "avx512_vnni" not in Path("/proc/cpuinfo").read_text():
        print("vnni_peak: this CPU has no AVX-512 VNNI", file=sys.stderr)
        return 2
    rate = vnni_per_second(args.threads)
    floor = {int(n): round(1e3 * args.params * int(n) / 64 / (rate * args.threads), 2) for n in args.rows.split(",")}
    report = {"vpdpbusd_per_s_per_core": rate, "cores": args.threads, "params": args.params,
              "compute_floor_ms": floor}
    text = json.dumps(report, indent=1)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
